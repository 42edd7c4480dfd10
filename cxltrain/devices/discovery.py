"""Finding real PMEM and CXL memory on this machine, and what `train` uses otherwise (docs/architecture.md §3).

Five places say a machine has persistent or CXL-attached memory. One finder reads each, from a
root that defaults to the real one, so a test can point it at a tree of files in the same format:

  ndctl list -N -R    NVDIMM regions and their namespaces (PMEM), when ndctl is installed
  daxctl list         device-DAX instances, also those onlined as system RAM, when daxctl is installed
  /proc/self/mounts   file systems mounted with `-o dax` (an fsdax namespace formatted ext4 or xfs)
  /dev                dax*.* character devices (device DAX) and pmem* block devices
  sysfs node*         NUMA nodes with memory and no CPUs: how a CXL memory expander (or PMEM onlined
                      as RAM) shows up once the kernel has onlined it

The same device can be seen by several finders (ndctl's namespace is also /dev/pmem0): `discover`
keeps the first report of each path, in the order above, because the tools know the most about it.

Example, on a machine with one fsdax namespace mounted at /mnt/pmem0 and no ndctl installed:

    report = discover(required_bytes=2 << 30)
    [(d.kind, d.path) for d in report.devices]  # [("fsdax-mount", "/mnt/pmem0"), ("pmem-block", "/dev/pmem0")]
    report.checked[0]                           # "ndctl: not installed"
    report.train.pool_path                      # "/dev/shm/cxltrain-<uid>-<hash>-train.pool": train's default
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import stat
import subprocess

from ..emulation import default_pool_path
from .libpmem import load as load_libpmem
from .mounts import Mount, mount_of, read_mounts
from .sysfs import char_device_size, device_dir, read_int
from .targets import resolve_backend


@dataclasses.dataclass(frozen=True)
class FoundDevice:
    """One PMEM or CXL memory device, as one source reported it.

    kind: namespace | dax-device | region | fsdax-mount | devdax | pmem-block | cpuless-node
    path: what to hand `train --pool` (a device, or a folder for a file), a node name, or None
    size: bytes, None when the source does not say
    """

    kind: str
    path: str | None
    size: int | None
    numa_node: int | None
    source: str
    note: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# ndctl / daxctl
# ---------------------------------------------------------------------------------------------
TOOL_TIMEOUT_S = 10.0  # both tools only read sysfs; longer means something is wrong


def run_tool(argv: list[str], *, timeout: float = TOOL_TIMEOUT_S) -> tuple[str | None, str | None]:
    """(stdout, None) when the tool ran and exited 0, else (None, why not) — never raises."""
    if shutil.which(argv[0]) is None:
        return None, "not installed"
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"`{' '.join(argv)}` timed out after {timeout:g} s"
    except OSError as e:
        return None, f"`{' '.join(argv)}` could not run: {e.strerror}"
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or ["no message"])[0]
        return None, f"`{' '.join(argv)}` exited {done.returncode}: {first}"
    return done.stdout, None


def json_documents(text: str) -> list:
    """Every JSON value in `text`. ndctl prints one object per bus back to back, which is not one
    JSON document, so a plain json.loads would refuse its output."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return values
        value, at = decoder.raw_decode(text, at)
        values.append(value)


def parse_ndctl(text: str) -> list[FoundDevice]:
    """Namespaces (and regions with no namespace) from `ndctl list -N -R` output.

    ndctl nests namespaces in regions, and regions in buses when asked for those: walk every
    object, taking "dev": "namespaceX.Y" entries as namespaces, with their region's NUMA node and
    persistence domain when they do not carry their own.
    """
    found: list[FoundDevice] = []

    def walk(node, region: dict | None) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item, region)
            return
        if not isinstance(node, dict):
            return
        dev = str(node.get("dev", ""))
        if dev.startswith("region"):
            region = node
            if not node.get("namespaces"):
                found.append(_ndctl_region(node))
        elif dev.startswith("namespace"):
            found.append(_ndctl_namespace(node, region or {}))
        for key in ("regions", "namespaces"):
            walk(node.get(key), region)

    walk(json_documents(text), None)
    return found


def _ndctl_namespace(ns: dict, region: dict) -> FoundDevice:
    mode = ns.get("mode", "unknown")
    dax_devices = (ns.get("daxregion") or {}).get("devices") or [{}]
    node = ns.get("blockdev") or ns.get("chardev") or dax_devices[0].get("chardev")
    note = f"{ns['dev']}, mode {mode}"
    if region.get("persistence_domain"):
        note += f", persistence domain {region['persistence_domain']}"
    note += {"fsdax": ": mount a file system on it with -o dax and put the pool in a file there",
             "devdax": ": use it whole as the pool (--pool /dev/...)",
             "raw": ": raw mode has no DAX; reconfigure with ndctl create-namespace -m fsdax"}.get(mode, "")
    return FoundDevice("namespace", f"/dev/{node}" if node else None, ns.get("size"),
                       ns.get("numa_node", region.get("numa_node")), "ndctl", note)


def _ndctl_region(region: dict) -> FoundDevice:
    note = f"{region.get('type', '')} region with no namespace; create one with ndctl create-namespace"
    return FoundDevice("region", None, region.get("size"), region.get("numa_node"), "ndctl", note.strip())


def parse_daxctl(text: str) -> list[FoundDevice]:
    """Device-DAX instances from `daxctl list` output (objects with a "chardev")."""
    found: list[FoundDevice] = []

    def walk(node) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            if "chardev" in node:
                mode = node.get("mode", "devdax")
                note = (f"onlined as system RAM on NUMA node {node.get('target_node')}: volatile memory, not a pool"
                        if mode == "system-ram" else "device DAX: use it whole as the pool (--pool /dev/...)")
                node_id = node.get("numa_node", node.get("target_node"))
                found.append(FoundDevice("dax-device", f"/dev/{node['chardev']}", node.get("size"), node_id,
                                         "daxctl", note))
            walk(node.get("devices"))

    walk(json_documents(text))
    return found


def from_tool(argv: list[str], parse) -> tuple[list[FoundDevice], str | None]:
    """Run one of the tools and parse its JSON; a failure is a note, never an exception."""
    out, note = run_tool(argv)
    if out is None:
        return [], note
    try:
        return parse(out), None
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        return [], f"`{' '.join(argv)}` printed something that is not JSON ({e})"


# ---------------------------------------------------------------------------------------------
# /proc/self/mounts, /dev, NUMA nodes
# ---------------------------------------------------------------------------------------------
def dax_mounts(mounts: list[Mount], sys_root: str = "/sys") -> list[FoundDevice]:
    """File systems mounted with DAX: a pool file there is mapped straight onto the media."""
    found = []
    for m in mounts:
        if m.dax_mode is None:
            continue
        name = os.path.basename(m.device)
        numa = read_int(os.path.join(sys_root, "block", name, "device", "numa_node"))
        note = (f"{m.fs_type} on {m.device}, every file mapped to the media: --pool {m.mount_point}/NAME.pool"
                if m.dax_mode == "always" else
                f"{m.fs_type} on {m.device}, dax=inode: only files with the DAX attribute are mapped to the media")
        found.append(FoundDevice("fsdax-mount", m.mount_point, _fs_bytes(m.mount_point), numa, "mounts", note))
    return found


def _fs_bytes(folder: str) -> int | None:
    try:
        return shutil.disk_usage(folder).total
    except OSError:
        return None


def device_nodes(dev_root: str = "/dev", sys_root: str = "/sys") -> list[FoundDevice]:
    """/dev/dax*.* character devices (device DAX) and /dev/pmem* block devices (fsdax or raw)."""
    found = []
    for path in sorted(glob.glob(os.path.join(dev_root, "dax*")) + glob.glob(os.path.join(dev_root, "pmem*"))):
        try:
            st = os.stat(path)
        except OSError:
            continue
        name = os.path.basename(path)
        if name.startswith("dax") and stat.S_ISCHR(st.st_mode):
            folder = device_dir(st.st_rdev, block=False, sys_root=sys_root)
            found.append(FoundDevice("devdax", path, char_device_size(st.st_rdev, sys_root), _numa_of(folder),
                                     "dev", f"device DAX: use it whole as the pool (--pool {path})"))
        elif name.startswith("pmem") and stat.S_ISBLK(st.st_mode):
            folder = device_dir(st.st_rdev, block=True, sys_root=sys_root)
            sectors = read_int(os.path.join(folder, "size"))  # block devices count 512-byte sectors
            found.append(FoundDevice("pmem-block", path, None if sectors is None else sectors * 512,
                                     _numa_of(folder), "dev",
                                     "PMEM block device: mount a file system on it with -o dax for a pool file"))
    return found


def _numa_of(folder: str) -> int | None:
    # device DAX has numa_node on the device itself; a pmem block device has it on its namespace
    for attr in ("numa_node", "device/numa_node"):
        node = read_int(os.path.join(folder, attr))
        if node is not None:
            return node
    return None


_MEMTOTAL = re.compile(r"^Node\s+\d+\s+MemTotal:\s+(\d+)\s*kB", re.MULTILINE)


def cpuless_nodes(node_root: str = "/sys/devices/system/node") -> tuple[list[FoundDevice], int]:
    """NUMA nodes with memory and an empty cpulist, and how many nodes there are in all."""
    found, nodes = [], sorted(glob.glob(os.path.join(node_root, "node[0-9]*")),
                              key=lambda p: int(os.path.basename(p)[4:]))
    for folder in nodes:
        try:
            with open(os.path.join(folder, "cpulist")) as f:
                if f.read().strip():
                    continue
            with open(os.path.join(folder, "meminfo")) as f:
                match = _MEMTOTAL.search(f.read())
        except OSError:
            continue
        size = int(match.group(1)) * 1024 if match else 0
        if size == 0:
            continue  # neither CPUs nor memory: an offline placeholder
        node = int(os.path.basename(folder)[4:])
        found.append(FoundDevice("cpuless-node", f"node{node}", size, node, "sysfs",
                                 "memory without CPUs (a CXL memory expander, or PMEM onlined as RAM): "
                                 f"volatile; reach it with numactl --membind={node}"))
    return found, len(nodes)


# ---------------------------------------------------------------------------------------------
# what train uses
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TrainDefault:
    """Where `cxltrain train` puts its pool when no --pool is given, and what it maps it with."""

    pool_path: str
    backend: str                 # resolve_backend's choice for that path
    fs_type: str | None          # of the folder holding it
    free_bytes: int | None       # free in that folder
    libpmem: bool                # PMDK's libpmem loaded: flushes are CLWB/CLFLUSHOPT + SFENCE
    hugepages_total: int         # configured huge pages (HugePages_Total in /proc/meminfo)
    hugepages_free: int
    hugepage_bytes: int
    hugetlbfs_mounts: tuple[str, ...]  # a pool folder there would be backed by huge pages

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "hugetlbfs_mounts": list(self.hugetlbfs_mounts)}


def train_default(required_bytes: int, mounts: list[Mount], meminfo_path: str = "/proc/meminfo") -> TrainDefault:
    """What `train` with no --pool uses for a pool of `required_bytes`."""
    path = default_pool_path(required_bytes)
    folder = os.path.dirname(path)
    mount = mount_of(folder)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    pages = _meminfo(meminfo_path)
    return TrainDefault(path, resolve_backend(path), mount.fs_type if mount else None, free,
                        load_libpmem() is not None, pages.get("HugePages_Total", 0), pages.get("HugePages_Free", 0),
                        pages.get("Hugepagesize", 0) * 1024,
                        tuple(m.mount_point for m in mounts if m.fs_type == "hugetlbfs"))


def _meminfo(path: str) -> dict[str, int]:
    values = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                number = rest.split()[:1]
                if number and number[0].isdigit():
                    values[name.strip()] = int(number[0])
    except OSError:
        pass
    return values


# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DeviceReport:
    devices: list[FoundDevice]
    checked: list[str]           # one line per source: what it found, or why it could not look
    train: TrainDefault

    def to_json(self) -> dict:
        return {"devices": [d.to_json() for d in self.devices], "checked": self.checked,
                "train": self.train.to_json()}


def discover(*, required_bytes: int = 0, ndctl: str = "ndctl", daxctl: str = "daxctl",
             mounts_path: str = "/proc/self/mounts", dev_root: str = "/dev", sys_root: str = "/sys",
             node_root: str = "/sys/devices/system/node", meminfo_path: str = "/proc/meminfo") -> DeviceReport:
    """Every source above, the devices they found (each path once), and the pool `train` would use."""
    devices: list[FoundDevice] = []
    checked: list[str] = []

    def take(label: str, found: list[FoundDevice], nothing: str, note: str | None = None) -> None:
        seen = {d.path for d in devices if d.path is not None}
        fresh = [d for d in found if d.path is None or d.path not in seen]
        devices.extend(fresh)
        checked.append(f"{label}: {note}" if note else f"{label}: {len(found)} found" if found else f"{label}: {nothing}")

    for argv, parse in (([ndctl, "list", "-N", "-R"], parse_ndctl), ([daxctl, "list"], parse_daxctl)):
        found, note = from_tool(argv, parse)
        take(os.path.basename(argv[0]), found, "no devices", note)
    mounts = read_mounts(mounts_path)
    take(mounts_path, dax_mounts(mounts, sys_root), f"{len(mounts)} mounts, none with -o dax")
    take(dev_root, device_nodes(dev_root, sys_root), "no dax* or pmem* device nodes")
    cpuless, nodes = cpuless_nodes(node_root)
    take(node_root, cpuless, f"{nodes} NUMA node(s), all with CPUs" if nodes else "no NUMA information")
    return DeviceReport(devices, checked, train_default(required_bytes, mounts, meminfo_path))
