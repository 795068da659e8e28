"""Each rank binds its GPU in comm.init(): device local_rank % visible devices, None without CuPy
or a device. A fake cupy records the selections, so no GPU or MPI is needed."""
import sys

from fakes.fake_cupy import CUDARuntimeError, FakeCupy

from npmegatron.comm.runtime import bind_device


def test_eight_local_ranks_on_eight_devices_take_one_each():
    fakes = [FakeCupy(devices=8) for _ in range(8)]
    assert [bind_device(rank, fake) for rank, fake in enumerate(fakes)] == list(range(8))
    assert [fake.used for fake in fakes] == [[rank] for rank in range(8)]


def test_one_visible_device_per_rank_is_device_zero():
    """A launcher (or CUDA_VISIBLE_DEVICES) that shows each rank its own single GPU."""
    fakes = [FakeCupy(devices=1) for _ in range(8)]
    assert [bind_device(rank, fake) for rank, fake in enumerate(fakes)] == [0] * 8
    assert all(fake.used == [0] for fake in fakes)


def test_more_ranks_than_devices_wrap_around():
    assert [bind_device(rank, FakeCupy(devices=2)) for rank in range(4)] == [0, 1, 0, 1]


def test_no_device_or_driver_binds_nothing():
    fake = FakeCupy(devices=CUDARuntimeError("cudaErrorNoDevice"))
    assert bind_device(3, fake) is None and fake.used == []
    fake = FakeCupy(devices=0)
    assert bind_device(3, fake) is None and fake.used == []


def test_no_cupy_binds_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)      # import cupy raises ImportError
    assert bind_device(0) is None
