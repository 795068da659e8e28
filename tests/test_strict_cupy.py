"""The strict CuPy stand-in (tests/fakes/strict_cupy) itself: what it refuses, what it counts,
and its NCCL over MPI (one rank in-process, four under mpiexec)."""
import copy
import pickle
import re
import sys
import threading
import types

import numpy
import pytest

from fakes.strict_cupy import strict_cupy, strict_cupy_env, strict_cupy_path


@pytest.fixture
def cp():
    with strict_cupy(devices=4) as module:
        yield module


def counted(cp, kind="sync"):
    return cp._strict.counters()[kind]


# --- activation ------------------------------------------------------------------------------

def test_the_stand_in_shadows_an_imported_cupy_and_restores_it(monkeypatch):
    real = types.ModuleType("cupy")
    monkeypatch.setitem(sys.modules, "cupy", real)
    cupyx_before = sys.modules.get("cupyx")      # the real cupyx, where CuPy is installed (CI)
    with strict_cupy() as cp:
        import cupy
        import cupyx.scipy.special
        assert cupy is cp and cupy.__file__.startswith(strict_cupy_path())
        assert cupyx.scipy.special.__file__.startswith(strict_cupy_path())
        assert sys.path[0] == strict_cupy_path()
    assert sys.modules["cupy"] is real and sys.modules.get("cupyx") is cupyx_before
    assert strict_cupy_path() not in sys.path
    assert strict_cupy_env()["PYTHONPATH"].split(":")[0] == strict_cupy_path()


# --- refused implicit conversions ------------------------------------------------------------

@pytest.mark.parametrize("convert", [
    lambda cp, x: numpy.asarray(x),
    lambda cp, x: numpy.exp(x),
    lambda cp, x: numpy.sum(x),
    lambda cp, x: numpy.ones(3) + x,
    lambda cp, x: x + numpy.ones(3),
    lambda cp, x: x * numpy.float64(2) + numpy.array(2.0),     # even a 0-d NumPy array
    lambda cp, x: x + [1, 2, 3],
    lambda cp, x: cp.add(x, numpy.ones(3)),
    lambda cp, x: cp.concatenate([x, numpy.ones(3)]),
    lambda cp, x: x.__setitem__(slice(None), numpy.ones(3)),
    lambda cp, x: x.__setitem__(slice(None), [1, 2, 3]),
    lambda cp, x: range(x[0]),                                    # CuPy has no __index__
], ids=["asarray", "ufunc", "function", "numpy+cupy", "cupy+numpy", "0-d", "list",
        "cupy.add", "concatenate", "setitem-numpy", "setitem-list", "index"])
def test_host_data_and_implicit_conversions_raise_type_error(cp, convert):
    x = cp.arange(3, dtype=cp.float64)
    with pytest.raises(TypeError):
        convert(cp, x)


def test_scalars_are_fine_and_cupy_rejects_numpy_only_names(cp):
    x = cp.arange(3, dtype=cp.float32)
    assert (x * numpy.float32(2) + 1.5).dtype == cp.float32 and (numpy.float32(2) * x).dtype == cp.float32
    assert cp.float32 is numpy.float32 and cp.inf == numpy.inf and cp.newaxis is None
    with pytest.raises(AttributeError):
        cp.fromregex                                 # NumPy has it, CuPy 14 does not
    with pytest.raises(AttributeError):
        x.ctypes                                     # nor this ndarray attribute
    with pytest.raises(TypeError):
        hash(x)


# --- counted host interactions ---------------------------------------------------------------

def test_each_host_sync_is_counted_with_its_reason_and_place(cp):
    x = cp.arange(4, dtype=cp.float64)
    one = x[1]
    x.get(), one.item(), x.tolist(), float(one), int(one), bool(one), complex(one)
    repr(x), str(x), f"{one:.1f}", cp.asnumpy(x), 2.0 in x, pickle.dumps(x)
    assert cp._strict.reasons() == {r: 1 for r in (
        "get", "item", "tolist", "float", "int", "bool", "complex", "repr", "str", "format",
        "asnumpy", "contains", "pickle")}
    assert counted(cp) == 13
    assert all(__file__ in r.where for r in cp._strict.records("sync"))
    assert "13 host sync(s)" in cp._strict.report()


def test_masks_and_nonzero_sync_deepcopy_does_not(cp):
    x = cp.arange(6, dtype=cp.float32)
    copy.deepcopy(x), x.copy(), x[1:3], x.sum(), cp.where(x > 2, x, 0)
    assert counted(cp) == 0
    x[x > 4] = 0.0
    assert x[x > 2].shape == (2,)
    cp.nonzero(x), cp.argwhere(x), cp.flatnonzero(x), cp.unique(x), cp.where(x > 1)
    assert cp._strict.reasons() == {"mask_index": 2, "nonzero": 1, "argwhere": 1,
                                    "flatnonzero": 1, "unique": 1, "where": 1}


def test_forbid_raises_at_the_sync_and_expect_counts(cp):
    x = cp.ones(3)
    with pytest.raises(cp._strict.HostSyncError, match="float"):
        with cp._strict.forbid():
            float(x.sum())
    with cp._strict.expect(sync=0, upload=1):
        cp.asarray(numpy.ones(2)) + x[:2]
    with pytest.raises(AssertionError, match="expected 0 host sync"):
        with cp._strict.expect(sync=0):
            x.tolist()


def test_uploads_are_counted_apart(cp):
    x = cp.arange(5)
    cp.asarray(numpy.ones(3)), cp.array([1, 2]), x[numpy.array([0, 2])], x[[1, 3]]
    cp.asarray(x), cp.stack([x, x]), x[cp.asarray(x)]
    assert cp._strict.reasons("upload") == {"asarray": 2, "index": 2}
    assert counted(cp) == 0 and cp.asarray(x) is x


def test_reductions_and_scalar_indexing_give_0d_views_as_cupy(cp):
    x = cp.arange(6, dtype=cp.float32).reshape(2, 3)
    for r in (x.sum(), x.max(), cp.mean(x), x[1, 2], cp.exp(1.0), cp.array_equal(x, x)):
        assert type(r) is cp.ndarray and r.shape == ()
    x[1, 2] += 10          # through a 0-d view
    row = x[0]
    row[0] = 7             # a view: writes through
    assert x.tolist() == [[7, 1, 2], [3, 4, 15]] and row.base is x.base
    assert numpy.isnan(cp.empty(3).get()).all()     # uninitialised memory shows


def test_what_a_numpy_autograd_needs_works_without_syncs(cp):
    x = cp.arange(12, dtype=cp.float32).reshape(3, 4)
    w = cp.ones((4, 2), cp.float32)
    with cp._strict.forbid("sync", "upload"):
        shapes = [(x @ w).shape, x.dot(w).shape, x.T.shape, x.swapaxes(0, 1).shape,
                  x.transpose(1, 0).shape, x.ravel().shape, x[None].squeeze().shape,
                  x.reshape(2, 6).shape, x.sum(axis=0).shape, x.mean(axis=1, keepdims=True).shape,
                  x.var().shape, x.std(axis=0).shape, x.cumsum(axis=1).shape, x.argmax(axis=1).shape,
                  x.clip(0, 1).shape, x.prod().shape, x.any().shape, x.all().shape,
                  x.view(cp.uint8).shape, cp.moveaxis(x, 0, 1).shape, cp.concatenate([x, x]).shape,
                  cp.stack([x, x], axis=-1).shape, cp.broadcast_to(x[:, :1], (3, 4)).shape]
        assert shapes[0] == (3, 2) and shapes[-1] == (3, 4)
        assert (len(x), x.ndim, x.size, x.nbytes, x.itemsize, x.strides) == (3, 2, 12, 48, 4, (16, 4))
        assert x.flags.c_contiguous and not x.T.flags.c_contiguous and [r.shape for r in x] == [(4,)] * 3
        total = cp.empty(4, cp.float32)
        assert cp.sum(x, axis=0, out=total) is total and cp.exp(x, out=x) is x    # out= in place
        x[:, 0] = cp.zeros(3, cp.float32)
        x[cp.arange(2)] = 1.0
        x += 1
        x /= x.max()
        assert x.astype(cp.float16).dtype == cp.float16 and x.astype(cp.float32, copy=False) is x
        assert cp.get_array_module(x) is cp and cp.get_array_module(numpy.ones(1)) is numpy
        assert type(copy.copy(x)) is cp.ndarray and (x == None).dtype == cp.bool_  # noqa: E711
    assert cp.empty(2, cp.int32).tolist() == [-1515870811] * 2     # 0xA5A5A5A5: never written
    assert cp.ndarray((2, 3), cp.float32).shape == (2, 3)


# --- devices ---------------------------------------------------------------------------------

def test_arrays_are_bound_to_their_device(cp):
    x = cp.ones(3)
    cp.cuda.Device(1).use()
    y = cp.ones(3)
    with pytest.raises(ValueError, match="Peer access is unavailable"):
        x + 1
    with pytest.raises(ValueError, match=r"resides \(0\)"):
        y + x
    moved = x.copy()                 # copies may cross devices, to the current one
    assert moved.device.id == 1 and (moved + y).device.id == 1
    with cp.cuda.Device(0):
        assert (x + 1).device.id == 0
    seen = []
    thread = threading.Thread(target=lambda: seen.append(cp.cuda.Device().id))
    thread.start()
    thread.join()
    assert seen == [0] and cp.cuda.Device().id == 1     # the current device is per thread
    assert [e["device"] for e in cp._strict.events("device.use")] == [1]


def test_device_count_and_bus_ids(cp, monkeypatch):
    assert cp.cuda.runtime.getDeviceCount() == 4
    buses = [cp.cuda.Device(i).pci_bus_id for i in range(4)]
    assert len(set(buses)) == 4 and buses[0] == "0000:10:00.0"
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError):
        cp.cuda.Device(4).use()
    for value in ("0", "none"):
        monkeypatch.setenv("STRICT_CUPY_DEVICES", value)
        with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="no CUDA-capable device"):
            cp.cuda.runtime.getDeviceCount()


def test_streams_and_events_are_logged(cp):
    compute, comms = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    assert cp.cuda.get_current_stream().ptr == 0 and len({compute.ptr, comms.ptr, 0}) == 3
    with compute:
        assert cp.cuda.get_current_stream() == compute
        done = cp.cuda.Event(disable_timing=True)
        done.record()
    assert cp.cuda.get_current_stream().ptr == 0
    comms.wait_event(done)
    assert done.done and counted(cp, "query") == 1
    done.synchronize(), comms.synchronize(), cp.cuda.Device().synchronize()
    assert cp._strict.reasons() == {"event.synchronize": 1, "stream.synchronize": 1,
                                    "device.synchronize": 1}
    waited = cp._strict.events("stream.wait_event")
    assert waited == [{"what": "stream.wait_event", "stream": comms.ptr, "event": done.ptr,
                       "recorded_on": compute.ptr}]
    cp.cuda.Device(1).use()
    with pytest.raises(RuntimeError, match="does not match"):
        compute.use()


# --- random ----------------------------------------------------------------------------------

def test_random_gives_cupy_arrays_and_no_saveable_state(cp):
    rng = cp.random.default_rng(3)
    draw = rng.random((2, 3), dtype=cp.float32)
    assert type(draw) is cp.ndarray and draw.dtype == cp.float32
    assert numpy.array_equal(draw.get(), cp.random.default_rng(3).random((2, 3), dtype=cp.float32).get())
    for obj, name in ((rng.bit_generator, "state"), (rng, "state"),
                      (cp.random.RandomState(0), "get_state"), (cp.random, "get_state")):
        with pytest.raises(AttributeError):
            getattr(obj, name)
    assert type(cp.random.randn(2, 2)) is cp.ndarray and cp.random.rand(3, dtype=cp.float32).dtype == cp.float32


# --- fuse ------------------------------------------------------------------------------------

def test_fuse_runs_the_body_on_proxies(cp):
    import cupyx.scipy.special

    @cp.fuse(kernel_name="gelu_chain")
    def gelu(x, scale):
        return 0.5 * x * (1 + cupyx.scipy.special.erf(x * scale))

    @cp.fuse
    def step(p, g, lr):
        p -= lr * cp.where(g > 0, g, 0).astype(p.dtype)

    x = cp.linspace(-2, 2, 5, dtype=cp.float32)
    out = gelu(x, 0.7)
    assert type(out) is cp.ndarray and out.dtype == cp.float32      # the weak 0.7 kept float32
    from scipy.special import erf
    hx = x.get()
    expect = 0.5 * hx * (1 + erf(hx * 0.7))
    assert numpy.allclose(out.get(), expect)
    p = cp.ones(5, dtype=cp.float32)
    assert step(p, x, 0.5) is None and p.get().tolist() == [1, 1, 1, 0.5, 0.0]
    assert cp._fusion.kernel_names[-2:] == ["gelu_chain", "step"]
    assert [e["name"] for e in cp._strict.events("fuse.call")] == ["gelu_chain", "step"]
    assert cp._strict.reasons() == {"get": 3}      # the .get() above, none inside the kernels


@pytest.mark.parametrize("body, error", [
    (lambda x: x if x > 0 else -x, TypeError),               # bool() of a proxy
    (lambda x: float(x) * x, TypeError),
    (lambda x: x[0] * 2, TypeError),                          # indexing
    (lambda x: x * x.shape[0], NotImplementedError),          # .shape
    (lambda x: x @ x, TypeError),
    (lambda x: x + CAPTURED[0], TypeError),                   # a concrete array
    (lambda x: x.sum() + x, ValueError),                      # pre- and post-reduction mixed
    (lambda x: x.sum(keepdims=True), NotImplementedError),
    (lambda x: 3.0, TypeError),                               # not an array result
], ids=["bool", "float", "index", "shape", "matmul", "captured", "after-reduction", "keepdims",
        "scalar-result"])
def test_fuse_refuses_what_cupy_fusion_refuses(cp, body, error):
    CAPTURED[:] = [cp.ones(3)]
    with pytest.raises(error):
        cp.fuse(kernel_name="bad")(body)(cp.ones(3))


CAPTURED = []


def test_fuse_call_forms(cp):
    with pytest.raises(TypeError, match="returns a decorator"):
        cp.fuse(lambda x: x, kernel_name="k")
    fused = cp.fuse(kernel_name="k")(lambda x: x * 2)
    with pytest.raises(TypeError):
        fused(x=cp.ones(2))                                  # positional arguments only
    with pytest.raises(TypeError):
        fused(cp.ones(2), numpy.ones(2))
    assert fused(numpy.ones(2)).tolist() == [2, 2]           # NumPy in: the plain body


# --- cupyx -----------------------------------------------------------------------------------

def test_scatter_add_sums_repeated_indices_and_erf(cp):
    import cupyx
    import cupyx.scipy.special
    t = cp.zeros(4)
    cupyx.scatter_add(t, cp.asarray([0, 0, 2]), cp.asarray([1.0, 2.0, 5.0]))
    assert t.tolist() == [3, 0, 5, 0]
    e = cupyx.scipy.special.erf(cp.asarray([0.0, 1.0]))
    assert type(e) is cp.ndarray and numpy.allclose(e.get(), [0.0, 0.8427007929497149])


# --- NCCL in-process (one rank: no MPI) ------------------------------------------------------

def test_nccl_ids_and_constructor_types(cp):
    nccl = cp.cuda.nccl
    uid = nccl.get_unique_id()
    assert type(uid) is bytes and len(uid) == 128 and uid != nccl.get_unique_id()
    for bad in (tuple(uid), numpy.frombuffer(uid, numpy.uint8), bytearray(uid)):
        with pytest.raises(TypeError):
            nccl.NcclCommunicator(1, bad, 0)
    with pytest.raises(TypeError):
        nccl.NcclCommunicator(1.0, uid, 0)
    with pytest.raises(ValueError):
        nccl.NcclCommunicator(1, uid[:64], 0)
    assert nccl.available and nccl.NCCL_FLOAT32 == 7 and nccl.NCCL_SUM == 0


def test_one_rank_communicator_checks_every_pointer(cp):
    nccl = cp.cuda.nccl
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    stream = cp.cuda.Stream()
    x, out = cp.arange(6, dtype=cp.float32), cp.empty(6, cp.float32)
    head = cp.zeros(12, cp.float32)[:6]
    comm.allReduce(x.data.ptr, out.data.ptr, 6, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
    assert out.tolist() == x.tolist()
    bad_calls = {
        "dtype": lambda: comm.allReduce(x.data.ptr, out.data.ptr, 3, nccl.NCCL_FLOAT64, 0, 0),
        "range": lambda: comm.allReduce(x.data.ptr, out.data.ptr, 7, nccl.NCCL_FLOAT32, 0, 0),
        "count": lambda: comm.bcast(head.data.ptr, 7, nccl.NCCL_FLOAT32, 0, 0),
        "strided": lambda: comm.bcast(x[::2].data.ptr, 3, nccl.NCCL_FLOAT32, 0, 0),
        "overlap": lambda: comm.allReduce(x.data.ptr, x[1:].data.ptr, 4, nccl.NCCL_FLOAT32, 0, 0),
        "host": lambda: comm.bcast(numpy.ones(3).ctypes.data, 3, nccl.NCCL_FLOAT64, 0, 0),
        "self-send": lambda: comm.send(x.data.ptr, 6, nccl.NCCL_FLOAT32, 0, 0),
    }
    bad_calls_say = {"dtype": "float32 array", "range": "not inside a live cupy array",
                     "count": "count 7 > the 6", "strided": "non-contiguous",
                     "overlap": "overlap", "host": "not inside", "self-send": "would hang"}
    for name, call in bad_calls.items():
        with pytest.raises(nccl.NcclError, match=bad_calls_say[name]):
            call()
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError):
        comm.bcast(x.data.ptr, 6, nccl.NCCL_FLOAT32, 0, 12345)       # not a stream
    nccl.groupStart()
    comm.send(x.data.ptr, 6, nccl.NCCL_FLOAT32, 0, stream.ptr)
    comm.recv(out.data.ptr, 6, nccl.NCCL_FLOAT32, 0, stream.ptr)
    nccl.groupEnd()
    assert out.tolist() == x.tolist()
    with pytest.raises(nccl.NcclError):
        nccl.groupEnd()
    summed = cp.zeros(6, cp.float32)
    nccl.groupStart()
    comm.allReduce(x.data.ptr, summed.data.ptr, 6, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
    assert summed.tolist() == [0] * 6                  # a collective in a group waits for groupEnd
    nccl.groupEnd()
    assert summed.tolist() == x.tolist()
    sends = cp._strict.events("nccl.send")
    assert sends[-1]["grouped"] and sends[-1]["stream"] == stream.ptr and sends[-1]["count"] == 6
    assert "mpi4py.MPI" not in sys.modules or not sys.modules["mpi4py.MPI"].Is_initialized()


# --- NCCL on four ranks ----------------------------------------------------------------------

def test_nccl_over_mpi_on_overlapping_groups(mpirun):
    """Pairs {0,1}, {2,3} and the world: collectives, in-order P2P in a group call, and a
    send that blocks until its receive is posted (see tests/ranks/strict_nccl.py)."""
    result = mpirun(4, "ranks/strict_nccl.py", args=["all"], env=strict_cupy_env(devices=4),
                    timeout=60)
    assert sorted(re.findall(r"rank (\d) ok", result.stdout)) == ["0", "1", "2", "3"]
