"""A stand-in for the few `cupy` attributes comm and the benchmarks touch, so GPU code paths are
tested on machines without CuPy: it records device selections and synchronisations."""
import types

import numpy


class CUDARuntimeError(RuntimeError):
    """cupy.cuda.runtime.CUDARuntimeError: no driver, no device."""


class FakeCupy(types.SimpleNamespace):
    """`devices` visible GPUs (an exception instance: getDeviceCount raises it); `bus_ids` their
    PCI bus ids; `log` gets "use N" and "sync" entries in call order."""

    def __init__(self, devices=1, bus_ids=None, log=None):
        super().__init__(ones=numpy.ones, empty=numpy.empty, float32=numpy.float32)
        self.devices, self.log = devices, [] if log is None else log
        count = 0 if isinstance(devices, Exception) else devices
        self.bus_ids = bus_ids or [f"0000:{i + 0x10:02X}:00.0" for i in range(count)]
        self.current = 0
        runtime = types.SimpleNamespace(getDeviceCount=self._count, CUDARuntimeError=CUDARuntimeError)
        self.cuda = types.SimpleNamespace(runtime=runtime, Device=self._device)

    def _count(self):
        if isinstance(self.devices, Exception):
            raise self.devices
        return self.devices

    def _device(self, index=None):
        fake = self
        index = fake.current if index is None else index

        class Device:
            pci_bus_id = fake.bus_ids[index]

            def use(self):
                fake.current = index
                fake.log.append(f"use {index}")

            def synchronize(self):
                fake.log.append("sync")

        return Device()

    @property
    def used(self):
        return [int(e.split()[1]) for e in self.log if e.startswith("use ")]
