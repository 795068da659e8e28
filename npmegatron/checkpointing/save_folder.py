"""The --save folder, claimed before the first iteration rather than found wanting after the last:
it must be writable, it is locked for the run's lifetime (two runs writing one folder mix their
checkpoints), and another run's checkpoints in it are replaced only with --overwrite.

A run is known by the random `run_id` its manifests carry; a resumed run keeps the id it loads.
"""
import fcntl
import json
import os
import shutil
import socket
import tempfile

from ..autograd import InputError
from .checkpoint import ITERATION_FOLDER, raise_if_any

LOCK_FILE = ".npmegatron.lock"


class SaveFolder:
    """Collective over `world`: rank 0 checks the folder and holds its lock; every rank raises
    the same InputError when the folder cannot be used."""

    def __init__(self, root, run_id, world, overwrite=False, resuming=False):
        self.root, self.run_id, self.world = root, run_id, world
        self.lock, self.replaced = None, []
        error = None
        if world.rank == 0:
            try:
                self._claim(overwrite, resuming)
            except InputError as e:
                error = str(e)
                self.release()
        raise_if_any(error, world)

    def _claim(self, overwrite, resuming):
        try:
            os.makedirs(self.root, exist_ok=True)
            self.lock = open(os.path.join(self.root, LOCK_FILE), "a+")
            os.remove(tempfile.mkstemp(dir=self.root, prefix=".write-test-")[1])
        except OSError as e:
            raise InputError(f"--save {self.root} is not a writable folder ({e.strerror}); choose "
                             "a folder this user can write") from None
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise InputError(f"--save {self.root} is in use by another run ({self._holder()}); wait "
                             "for it to end or choose another --save") from None
        self.lock.truncate(0)
        self.lock.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        self.lock.flush()
        others = self._other_runs()
        if others and not (overwrite or resuming):
            name, run = others[0]
            raise InputError(f"--save {self.root} holds checkpoints of another run ({name}, run id "
                             f"{run or 'unknown'}); resume it with --load {self.root}, pass "
                             "--overwrite to replace them, or choose another --save")
        self.replaced = [name for name, _ in others] if overwrite else []

    def _holder(self):
        self.lock.seek(0)
        try:
            holder = json.loads(self.lock.read())
            return f"host {holder['host']}, process {holder['pid']}"
        except (ValueError, KeyError, TypeError):
            return "its host and process unknown"

    def _other_runs(self):
        """[(iteration folder, its run id)] of the checkpoints here that belong to another run."""
        found = []
        for name in sorted(os.listdir(self.root)):
            if not ITERATION_FOLDER.fullmatch(name):
                continue
            try:
                with open(os.path.join(self.root, name, "manifest.json")) as f:
                    run = json.load(f).get("run_id")
            except (OSError, ValueError, AttributeError):
                run = None                  # unreadable or foreign: not this run's
            if run != self.run_id:
                found.append((name, run))
        return found

    def saved(self, folder):
        """After this run's checkpoint `folder` is complete: with --overwrite, the replaced run's
        checkpoints go now, never before this run has one of its own."""
        if self.world.rank == 0:
            for name in self.replaced:
                if name != os.path.basename(folder):
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        self.replaced = []

    def release(self):
        if self.lock is not None:
            self.lock.close()           # closing the file drops the lock
            self.lock = None
