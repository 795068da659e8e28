"""The rank grid matches Megatron's layout; checked in one process for 16 ranks."""
import pytest

from npmegatron.autograd import InputError
from npmegatron.comm import grid_coordinates, grid_ranks


def test_sixteen_ranks_tp2_pp4_match_megatron():
    layout = grid_ranks(16, tp=2, pp=4, dp=2)
    assert layout["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert layout["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert layout["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert layout["mp"] == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert layout["embd"] == [[0, 12], [1, 13], [2, 14], [3, 15]]


def test_coordinates_invert_the_rank_formula():
    tp, pp, dp = 2, 4, 2
    for rank in range(16):
        t, d, p = grid_coordinates(rank, tp, dp)
        assert rank == t + tp * (d + dp * p)


def test_every_rank_is_in_exactly_one_group_per_axis():
    layout = grid_ranks(24, tp=2, pp=3, dp=4)
    for axis in ("tp", "dp", "pp", "mp"):
        flat = sorted(r for group in layout[axis] for r in group)
        assert flat == list(range(24)), axis
    assert layout["embd"][0] == [0, 16]


def test_single_stage_embedding_group_is_one_rank():
    assert grid_ranks(2, tp=2, pp=1, dp=1)["embd"] == [[0], [1]]


def test_world_size_mismatch_is_one_clear_error():
    with pytest.raises(InputError, match=r"world size 6 does not equal TP x PP x DP = 2 x 2 x 2 = 8"):
        grid_ranks(6, 2, 2, 2)
    with pytest.raises(InputError, match="tensor-parallel size 0"):
        grid_ranks(4, 0, 2, 2)


def test_context_parallel_lies_inside_each_data_parallel_replica():
    """Megatron's order with CP: TP fastest, then CP, then DP, then PP; gradients are averaged
    over DP x CP, the model-parallel group is TP x PP."""
    layout = grid_ranks(16, tp=2, pp=2, dp=2, cp=2)
    assert layout["tp"][:2] == [[0, 1], [2, 3]]
    assert layout["cp"][:3] == [[0, 2], [1, 3], [4, 6]]
    assert layout["dp"][:2] == [[0, 4], [1, 5]]
    assert layout["dp_cp"][:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout["pp"][0] == [0, 8] and layout["mp"][0] == [0, 1, 8, 9]
    for axis in ("tp", "cp", "dp", "dp_cp", "pp", "mp"):
        assert sorted(r for group in layout[axis] for r in group) == list(range(16)), axis
    for rank in range(16):
        t, d, p = grid_coordinates(rank, 2, 2, cp=2)
        assert rank == t + 2 * ((rank // 2) % 2 + 2 * (d + 2 * p))
    assert grid_ranks(16, tp=2, pp=4, dp=2) == {**grid_ranks(16, tp=2, pp=4, dp=2, cp=1)}
    with pytest.raises(InputError, match=r"TP x PP x DP x CP = 2 x 2 x 2 x 2 = 16"):
        grid_ranks(8, 2, 2, 2, 2)


def test_expert_parallel_ranks_come_from_the_data_and_context_parallel_ranks():
    """Megatron-Core's expert grid: EP neighbouring ranks of the DP x CP ranks (CP first, as ranks
    run), so EP may span CP ranks; edp: every EP-th of them, holding the same experts."""
    layout = grid_ranks(16, tp=2, pp=1, dp=2, cp=4, ep=4)
    assert layout["ep"][:3] == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7]]     # the four CP ranks of one DP
    assert layout["edp"][:2] == [[0, 8], [2, 10]]
    wide = grid_ranks(16, tp=2, pp=1, dp=2, cp=4, ep=8)     # EP across DP and CP: one group a TP rank
    assert wide["ep"] == [[0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]]
    assert wide["edp"][:2] == [[0], [2]]
    narrow = grid_ranks(8, tp=1, pp=2, dp=2, cp=2, ep=2)
    assert narrow["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and narrow["edp"][:2] == [[0, 2], [1, 3]]
    for grid, world in ((layout, 16), (wide, 16), (narrow, 8)):
        for axis in ("ep", "edp"):
            assert sorted(r for group in grid[axis] for r in group) == list(range(world)), axis
