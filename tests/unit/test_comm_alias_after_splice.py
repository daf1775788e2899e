"""Two monitors' cc_distribution wrappers in one process: when the older one is closed (spliced out from
under the newer one), the newer one's next install must still patch module-level aliases of the
collectives (`from torch.distributed import all_reduce`, Megatron's `dist_all_gather_func`). Its alias
scan had recorded the older wrapper there; once the aliases held torch's own function again, they were
never patched again and their calls went unrecorded."""

from __future__ import annotations

import sys
import types

import torch.distributed as dist

from trainermon.comm.patch import Patches
from trainermon.comm.spec import all_specs


class _Idle:
    def active(self) -> bool:
        return False


def test_an_alias_is_patched_again_after_the_older_monitor_is_spliced_out():
    specs = [s for s in all_specs() if s.attr == "all_reduce" and s.module == "dist"]
    original = dist.all_reduce
    alias = types.ModuleType("trainermon_test_alias_module")
    alias.all_reduce = dist.all_reduce  # a module-global alias
    sys.modules[alias.__name__] = alias
    older, newer = Patches(), Patches()
    try:
        older.install(specs, False, _Idle())
        newer.install(specs, False, _Idle())
        assert alias.all_reduce is dist.all_reduce is not original  # the newer wrapper, over the older
        older.uninstall()  # the older monitor closed while the newer lives: spliced out
        newer.uninstall()  # the newer monitor's uncollected step
        assert dist.all_reduce is original and alias.all_reduce is original
        newer.install(specs, False, _Idle())  # its next collected step
        assert dist.all_reduce is not original
        assert alias.all_reduce is dist.all_reduce  # was: torch's own function, unrecorded
    finally:
        newer.uninstall()
        older.uninstall()
        del sys.modules[alias.__name__]
    assert dist.all_reduce is original and alias.all_reduce is original
