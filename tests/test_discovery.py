"""Device discovery: each finder on a fixture tree of real-format files, the tools as real processes,
and `cxltrain devices` on this machine."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from cxltrain.devices import discovery
from cxltrain.devices.discovery import (
    cpuless_nodes,
    dax_mounts,
    device_nodes,
    discover,
    from_tool,
    parse_daxctl,
    parse_ndctl,
    run_tool,
)
from cxltrain.devices.mounts import read_mounts
from cxltrain.emulation import cxl
from helpers import cxltrain
from test_cli import last_json

GIB = 1 << 30


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------
# ndctl / daxctl output, written from the fields ndctl-list(1) and daxctl-list(1) document
# ---------------------------------------------------------------------------------------------
# `ndctl list -N -R`: regions with their namespaces; one region is empty.
NDCTL_REGIONS = """\
{
  "regions":[
    {
      "dev":"region0", "size":270582939648, "available_size":0, "type":"pmem", "numa_node":0,
      "persistence_domain":"memory_controller",
      "namespaces":[
        {"dev":"namespace0.0", "mode":"fsdax", "map":"dev", "size":266352984064,
         "uuid":"5a2b3c4d-0000-4000-8000-000000000001", "sector_size":512, "align":2097152, "blockdev":"pmem0"},
        {"dev":"namespace0.1", "mode":"devdax", "map":"dev", "size":2147483648, "numa_node":1,
         "daxregion":{"id":0, "size":2147483648, "align":2097152,
                      "devices":[{"chardev":"dax0.1", "size":2147483648, "target_node":2, "mode":"devdax"}]}},
        {"dev":"namespace0.2", "mode":"raw", "size":1073741824, "blockdev":"pmem0.2"}
      ]
    },
    {"dev":"region1", "size":270582939648, "available_size":270582939648, "type":"pmem", "numa_node":1}
  ]
}
"""

# Older ndctl prints one object per bus, back to back: several JSON documents in one output.
NDCTL_BUSES = """\
{"provider":"e820", "dev":"ndbus0",
 "namespaces":[{"dev":"namespace3.0", "mode":"fsdax", "size":8589934592, "blockdev":"pmem3"}]}
{"provider":"ACPI.NFIT", "dev":"ndbus1"}
"""

DAXCTL = """\
[
  {"chardev":"dax0.1", "size":2147483648, "target_node":2, "align":2097152, "mode":"devdax"},
  {"chardev":"dax1.0", "size":68719476736, "target_node":3, "align":2097152, "mode":"system-ram",
   "online_memblocks":32, "total_memblocks":32}
]
"""


def test_ndctl_regions_and_namespaces():
    found = {d.path or d.note: d for d in parse_ndctl(NDCTL_REGIONS)}
    fsdax = found["/dev/pmem0"]
    assert (fsdax.kind, fsdax.size, fsdax.numa_node, fsdax.source) == ("namespace", 266352984064, 0, "ndctl")
    assert "fsdax" in fsdax.note and "memory_controller" in fsdax.note and "-o dax" in fsdax.note
    devdax = found["/dev/dax0.1"]  # its own numa_node wins over the region's
    assert (devdax.size, devdax.numa_node) == (2147483648, 1) and "--pool" in devdax.note
    assert "no DAX" in found["/dev/pmem0.2"].note
    (empty,) = [d for d in found.values() if d.kind == "region"]
    assert (empty.path, empty.size, empty.numa_node) == (None, 270582939648, 1)
    assert "create-namespace" in empty.note
    assert len(found) == 4


def test_ndctl_objects_back_to_back():
    (ns,) = parse_ndctl(NDCTL_BUSES)
    assert (ns.path, ns.size, ns.numa_node) == ("/dev/pmem3", 8589934592, None)


def test_daxctl_devices():
    devdax, ram = parse_daxctl(DAXCTL)
    assert (devdax.kind, devdax.path, devdax.size, devdax.numa_node) == ("dax-device", "/dev/dax0.1", 2 * GIB, 2)
    assert ram.path == "/dev/dax1.0" and "system RAM on NUMA node 3" in ram.note


def test_nothing_to_list_is_no_devices():
    assert parse_ndctl("") == [] and parse_daxctl("[]\n") == []


# ---------------------------------------------------------------------------------------------
# the tools as real processes: output, failures and hangs are notes, never exceptions
# ---------------------------------------------------------------------------------------------
def tool(folder: Path, name: str, body: str) -> str:
    """A real executable standing in for the tool's binary (the machine has no NVDIMMs to list)."""
    path = write(folder / name, f"#!{sys.executable}\nimport sys, time\n{body}\n")
    path.chmod(0o755)
    return str(path)


def printing(folder: Path, name: str, output: str) -> str:
    """A tool that prints `output`, as ndctl or daxctl would."""
    sample = write(folder / f"{name}.out", output)
    return tool(folder, name, f"sys.stdout.write(open({str(sample)!r}).read())")


def test_tools_run_for_real_and_failures_become_notes(tmp_path):
    good = printing(tmp_path, "ndctl", NDCTL_REGIONS)
    found, note = from_tool([good, "list", "-N", "-R"], parse_ndctl)
    assert note is None and {d.path for d in found} >= {"/dev/pmem0", "/dev/dax0.1"}

    failing = tool(tmp_path, "failing", "print('error: no nvdimm bus', file=sys.stderr); sys.exit(3)")
    assert from_tool([failing, "list"], parse_ndctl) == ([], f"`{failing} list` exited 3: error: no nvdimm bus")
    garbled = tool(tmp_path, "garbled", "print('{not json')")
    found, note = from_tool([garbled], parse_ndctl)
    assert found == [] and "not JSON" in note
    hanging = tool(tmp_path, "hanging", "time.sleep(30)")
    assert run_tool([hanging], timeout=0.5) == (None, f"`{hanging}` timed out after 0.5 s")
    assert run_tool([str(tmp_path / "absent")]) == (None, "not installed")


# ---------------------------------------------------------------------------------------------
# /proc/mounts, sysfs NUMA nodes, /dev
# ---------------------------------------------------------------------------------------------
MOUNTS = """\
/dev/vda1 / ext4 rw,relatime 0 0
tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0
/dev/pmem0 {mnt} ext4 rw,relatime,dax=always 0 0
/dev/pmem1 /mnt/pmem\\040one xfs rw,relatime,attr2,dax,inode64 0 0
/dev/pmem2 /mnt/pmem2 xfs rw,relatime,dax=inode 0 0
/dev/pmem3 /mnt/pmem3 ext4 rw,relatime,dax=never 0 0
hugetlbfs /dev/hugepages hugetlbfs rw,relatime,pagesize=2M 0 0
"""


def test_dax_mounts(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounts = read_mounts(str(write(tmp_path / "mounts", MOUNTS.format(mnt=mnt))))
    write(tmp_path / "sys/block/pmem0/device/numa_node", "1\n")
    always, spaced, per_inode = dax_mounts(mounts, str(tmp_path / "sys"))
    assert (always.kind, always.path, always.numa_node, always.source) == ("fsdax-mount", str(mnt), 1, "mounts")
    assert always.size == os.statvfs(mnt).f_blocks * os.statvfs(mnt).f_frsize
    assert f"--pool {mnt}/" in always.note
    assert (spaced.path, spaced.size, spaced.numa_node) == ("/mnt/pmem one", None, None)  # not mounted here
    assert "dax=inode" in per_inode.note


def test_cpuless_numa_nodes(tmp_path):
    nodes = tmp_path / "node"
    write(nodes / "node0/cpulist", "0-1\n")
    write(nodes / "node0/meminfo", "Node 0 MemTotal:       11233496 kB\nNode 0 MemFree:  9857864 kB\n")
    write(nodes / "node10/cpulist", "\n")  # CXL expander: memory, no CPUs
    write(nodes / "node10/meminfo", "Node 10 MemTotal:      16777216 kB\nNode 10 MemFree: 16777216 kB\n")
    write(nodes / "node2/cpulist", "\n")  # neither CPUs nor memory
    write(nodes / "node2/meminfo", "Node 2 MemTotal:              0 kB\n")
    write(nodes / "possible", "0-10\n")
    (expander,), total = cpuless_nodes(str(nodes))
    assert total == 3
    assert (expander.kind, expander.path, expander.size, expander.numa_node) == ("cpuless-node", "node10", 16 * GIB, 10)
    assert "numactl --membind=10" in expander.note


def make_device_tree(tmp_path: Path) -> tuple[Path, Path]:
    """A /dev with dax0.0 (character) and pmem0 (block) nodes, and the sysfs attributes behind them."""
    dev, sys_root = tmp_path / "dev", tmp_path / "sys"
    dev.mkdir()
    try:
        os.mknod(dev / "dax0.0", 0o600 | stat.S_IFCHR, os.makedev(252, 0))
        os.mknod(dev / "pmem0", 0o600 | stat.S_IFBLK, os.makedev(259, 0))
    except PermissionError:
        pytest.skip("making device nodes needs root (CAP_MKNOD)")
    (dev / "pmem-notes.txt").write_text("a regular file, not a device")
    write(sys_root / "dev/char/252:0/size", f"{4 * GIB}\n")
    write(sys_root / "dev/char/252:0/numa_node", "1\n")
    write(sys_root / "dev/block/259:0/size", f"{8 * GIB // 512}\n")  # sectors
    write(sys_root / "dev/block/259:0/device/numa_node", "0\n")
    return dev, sys_root


def test_device_nodes(tmp_path):
    dev, sys_root = make_device_tree(tmp_path)
    dax, pmem = device_nodes(str(dev), str(sys_root))
    assert (dax.kind, dax.path, dax.size, dax.numa_node) == ("devdax", str(dev / "dax0.0"), 4 * GIB, 1)
    assert (pmem.kind, pmem.path, pmem.size, pmem.numa_node) == ("pmem-block", str(dev / "pmem0"), 8 * GIB, 0)


def test_discover_says_what_it_looked_at(tmp_path):
    ndctl = printing(tmp_path, "ndctl", NDCTL_BUSES)
    mounts = write(tmp_path / "mounts", "/dev/vda1 / ext4 rw 0 0\nnone /mnt/huge hugetlbfs rw,pagesize=2M 0 0\n")
    nodes, dev = tmp_path / "node", tmp_path / "dev"
    write(nodes / "node0/cpulist", "0-1\n")
    dev.mkdir()
    meminfo = write(tmp_path / "meminfo", "HugePages_Total:       4\nHugePages_Free:        3\nHugepagesize:       2048 kB\n")
    report = discover(ndctl=ndctl, daxctl=str(tmp_path / "no-daxctl"), mounts_path=str(mounts), dev_root=str(dev),
                      sys_root=str(tmp_path / "sys"), node_root=str(nodes), meminfo_path=str(meminfo))
    assert [(d.kind, d.path, d.source) for d in report.devices] == [("namespace", "/dev/pmem3", "ndctl")]
    assert report.checked == ["ndctl: 1 found", "no-daxctl: not installed",
                              f"{mounts}: 2 mounts, none with -o dax", f"{dev}: no dax* or pmem* device nodes",
                              f"{nodes}: 1 NUMA node(s), all with CPUs"]
    train = report.train
    assert (train.hugepages_total, train.hugepages_free, train.hugepage_bytes) == (4, 3, 2 << 20)
    assert train.hugetlbfs_mounts == ("/mnt/huge",)
    assert json.loads(json.dumps(report.to_json()))["devices"][0]["path"] == "/dev/pmem3"


def test_discover_keeps_the_first_report_of_a_path(tmp_path):
    ndctl, daxctl = printing(tmp_path, "ndctl", NDCTL_REGIONS), printing(tmp_path, "daxctl", DAXCTL)
    empty = tmp_path / "empty"
    empty.mkdir()
    report = discover(ndctl=ndctl, daxctl=daxctl, mounts_path=str(empty / "mounts"), dev_root=str(empty),
                      sys_root=str(empty), node_root=str(empty), meminfo_path=str(empty / "meminfo"))
    paths = [d.path for d in report.devices if d.path]
    assert sorted(paths) == ["/dev/dax0.1", "/dev/dax1.0", "/dev/pmem0", "/dev/pmem0.2"]
    assert next(d for d in report.devices if d.path == "/dev/dax0.1").source == "ndctl"
    assert report.checked[:2] == ["ndctl: 4 found", "daxctl: 2 found"]


# ---------------------------------------------------------------------------------------------
# the real machine, through the command line
# ---------------------------------------------------------------------------------------------
def test_cxltrain_devices_on_this_machine():
    result = cxltrain("devices", "--json")
    assert result.returncode == 0, result.stderr
    summary = last_json(result.stdout)
    assert summary["train"]["pool_path"].endswith(cxl.pool_name())
    assert summary["train"]["backend"] in ("emulated", "pmem", "msync")
    assert len(summary["checked"]) == 5
    first = result.stdout.splitlines()[0]
    assert first.startswith("kind") if summary["devices"] else first.startswith("no PMEM or CXL memory found")
    assert "train uses " in result.stdout and "huge pages:" in result.stdout
    assert discovery.FoundDevice.__dataclass_fields__.keys() == {"kind", "path", "size", "numa_node", "source", "note"}
