"""`cxltrain devices`: the PMEM/CXL memory of this machine, and where `train` puts its pool."""

from __future__ import annotations

import json


def add_devices(sub) -> None:
    d = sub.add_parser("devices", help="list PMEM/CXL devices on this machine and the pool train uses",
                       description="List real PMEM and CXL memory (ndctl/daxctl when installed, -o dax mounts, "
                                   "/dev/dax* and /dev/pmem*, NUMA nodes without CPUs) and the pool `train` uses "
                                   "when no --pool is given. Never writes.")
    d.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    d.set_defaults(run=_run_devices)


def _gib(size: int | None) -> str:
    return "?" if size is None else f"{size / (1 << 30):.1f} GiB"


def _run_devices(args) -> int:
    from ..devices.discovery import discover
    from ..jobs.config import TrainConfig
    from ..jobs.train import pool_bytes

    # the default train config's pool size decides whether /dev/shm has room for it, as in `train`
    report = discover(required_bytes=pool_bytes(TrainConfig()))
    if report.devices:
        print(f"{'kind':<13} {'path':<24} {'size':>11} {'numa':>4}  {'source':<7} note")
        for d in report.devices:
            numa = "-" if d.numa_node is None else str(d.numa_node)
            print(f"{d.kind:<13} {d.path or '-':<24} {_gib(d.size):>11} {numa:>4}  {d.source:<7} {d.note}")
        print("looked at:")
    else:
        print("no PMEM or CXL memory found on this machine; looked at:")
    for line in report.checked:
        print(f"  {line}")
    t = report.train
    print(f"train uses {t.pool_path} when no --pool is given: {t.backend} backend on {t.fs_type or 'unknown'}, "
          f"{_gib(t.free_bytes)} free" + ("; --pool PATH puts it on a device above" if report.devices else ""))
    print("  libpmem: " + ("loaded: persist is a cache-line flush + fence" if t.libpmem else
                          "not installed: persist on the emulated device does nothing (the page is the media)"))
    pages = (f"{t.hugepages_free} of {t.hugepages_total} free ({t.hugepage_bytes >> 20} MiB each)" if t.hugepages_total
             else "none reserved (vm.nr_hugepages = 0)")
    print(f"  huge pages: {pages}; hugetlbfs mounts: {', '.join(t.hugetlbfs_mounts) or 'none'}")
    if args.json:
        print(json.dumps(report.to_json()))
    return 0
