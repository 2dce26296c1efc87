"""Run a command under the seccomp part of a unit's sandbox, the way systemd installs it, so a
test can show a stage lives with its unit's settings without systemd running as PID 1:

- SystemCallFilter= (an allow list, with @default added as systemd does, minus ~ lists; the
  @groups expanded by `systemd-analyze syscall-filter`), SystemCallErrorNumber= (else a denied
  call kills the process), SystemCallArchitectures=native;
- MemoryDenyWriteExecute=yes: mmap() with PROT_WRITE|PROT_EXEC, mprotect()/pkey_mprotect()
  adding PROT_EXEC and shmat() with SHM_EXEC fail with EPERM (systemd 252's seccomp rule);
- RestrictAddressFamilies= (an allow list): socket() of any other family fails with EAFNOSUPPORT;
- RestrictRealtime=yes: sched_setscheduler() to a policy other than SCHED_OTHER, SCHED_BATCH or
  SCHED_IDLE fails with EPERM.

The namespace settings (ProtectSystem=, PrivateTmp=, ...) are not reproduced. x86-64 only.

    python tests/ops/seccomp_exec.py SPEC.json COMMAND [ARG...]    # installs the filter, then execs
"""
from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import platform
import re
import socket
import struct
import subprocess
import sys
from dataclasses import asdict, dataclass

SYSCALL_HEADER = "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"
AUDIT_ARCH_X86_64 = 0xC000003E
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
PROT_WRITE, PROT_EXEC, SHM_EXEC = 0x2, 0x4, 0o100000
# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6] (low halves first)
_NR, _ARCH = 0, 4
_ARG = [16 + 8 * i for i in range(6)]
SCHED_FIFO, SCHED_RR, SCHED_IDLE = 1, 2, 5
# classic BPF opcodes
_LD_ABS, _JEQ, _JGT, _AND, _RET = 0x20, 0x15, 0x25, 0x54, 0x06


@dataclass
class SeccompSpec:
    allowed_syscalls: list[str] | None = None
    """None: no SystemCallFilter=."""
    errno_number: int | None = None
    """What a call outside the allow list returns; None kills the process (systemd's default)."""
    native_only: bool = False
    deny_write_execute: bool = False
    address_families: list[str] | None = None
    """e.g. ["AF_UNIX", "AF_INET"]; None: no RestrictAddressFamilies=."""
    restrict_realtime: bool = False


def supported() -> str | None:
    """Why this host cannot run the emulation, or None if it can."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return "the seccomp emulation covers Linux on x86-64 only"
    if not os.path.exists(SYSCALL_HEADER):
        return f"{SYSCALL_HEADER} (linux-libc-dev) is missing: no system call numbers"
    return None


@functools.lru_cache(maxsize=None)
def syscall_group(name: str) -> frozenset[str]:
    """The system calls of a systemd @group, nested groups expanded."""
    out = subprocess.run(["systemd-analyze", "syscall-filter", name], capture_output=True, text=True, check=True)
    calls: set[str] = set()
    for line in out.stdout.splitlines()[1:]:
        word = line.strip()
        if word.startswith("@"):
            calls |= syscall_group(word)
        elif word and not word.startswith("#"):
            calls.add(word)
    return frozenset(calls)


def _names(words: str) -> set[str]:
    return set().union(*(syscall_group(w) if w.startswith("@") else {w} for w in words.split()))


def spec_from_unit(unit) -> SeccompSpec:
    """The seccomp settings of a parsed unit (tests/ops/unit_files.Unit)."""
    allowed: set[str] | None = None
    for value in unit.values("Service", "SystemCallFilter"):
        if value.startswith("~"):
            if allowed is None:
                raise ValueError("a deny-list SystemCallFilter= is not emulated")
            allowed -= _names(value[1:])
        else:
            allowed = (allowed if allowed is not None else set(syscall_group("@default"))) | _names(value)
    errno_name = unit.value("Service", "SystemCallErrorNumber")
    families = unit.value("Service", "RestrictAddressFamilies")
    if families and families.startswith("~"):
        raise ValueError("a deny-list RestrictAddressFamilies= is not emulated")
    return SeccompSpec(
        allowed_syscalls=sorted(allowed) if allowed is not None else None,
        errno_number=getattr(errno, errno_name) if errno_name else None,
        native_only=unit.value("Service", "SystemCallArchitectures") == "native",
        deny_write_execute=unit.value("Service", "MemoryDenyWriteExecute") == "yes",
        address_families=families.split() if families else None,
        restrict_realtime=unit.value("Service", "RestrictRealtime") == "yes")


def syscall_numbers() -> dict[str, int]:
    with open(SYSCALL_HEADER, encoding="utf-8") as f:
        return {m.group(1): int(m.group(2)) for m in re.finditer(r"#define __NR_(\w+)\s+(\d+)", f.read())}


Instruction = tuple[int, int, int, int]
"""(code, jump if true, jump if false, k); jumps are relative and at most 255, so each rule
below skips only its own few steps."""


def _load(offset: int) -> Instruction:
    return (_LD_ABS, 0, 0, offset)


def _ret(action: int) -> Instruction:
    return (_RET, 0, 0, action)


def build_program(spec: SeccompSpec) -> list[Instruction]:
    """The classic BPF program: the architecture check, the deny rules, then the allow list."""
    numbers = syscall_numbers()
    prog = [_load(_ARCH), (_JEQ, 1, 0, AUDIT_ARCH_X86_64),
            _ret(SECCOMP_RET_KILL_PROCESS if spec.native_only else SECCOMP_RET_ALLOW)]
    if spec.deny_write_execute:
        for name, mask in (("mmap", PROT_WRITE | PROT_EXEC), ("mprotect", PROT_EXEC), ("pkey_mprotect", PROT_EXEC),
                           ("shmat", SHM_EXEC)):
            prog += [_load(_NR), (_JEQ, 0, 4, numbers[name]),  # another call: skip the 4 steps of this rule
                     _load(_ARG[2]), (_AND, 0, 0, mask), (_JEQ, 0, 1, mask), _ret(SECCOMP_RET_ERRNO | errno.EPERM)]
    if spec.address_families is not None:
        families = [getattr(socket, f) for f in spec.address_families]
        prog += [_load(_NR), (_JEQ, 0, len(families) + 2, numbers["socket"]), _load(_ARG[0])]
        prog += [(_JEQ, len(families) - i, 0, family) for i, family in enumerate(families)]  # allowed: skip the deny
        prog += [_ret(SECCOMP_RET_ERRNO | errno.EAFNOSUPPORT)]
    if spec.restrict_realtime:
        prog += [_load(_NR), (_JEQ, 0, 5, numbers["sched_setscheduler"]), _load(_ARG[1]),
                 (_JEQ, 2, 0, SCHED_FIFO), (_JEQ, 1, 0, SCHED_RR),
                 (_JGT, 0, 1, SCHED_IDLE),  # SCHED_DEADLINE, and any policy with SCHED_RESET_ON_FORK
                 _ret(SECCOMP_RET_ERRNO | errno.EPERM)]
    if spec.allowed_syscalls is None:
        return prog + [_ret(SECCOMP_RET_ALLOW)]
    prog.append(_load(_NR))
    for name in spec.allowed_syscalls:
        if name in numbers:  # names of other architectures (mmap2, ...) have no number here
            prog += [(_JEQ, 0, 1, numbers[name]), _ret(SECCOMP_RET_ALLOW)]
    denied = (SECCOMP_RET_ERRNO | spec.errno_number) if spec.errno_number is not None else SECCOMP_RET_KILL_PROCESS
    return prog + [_ret(denied)]


def install(spec: SeccompSpec) -> None:
    """Install the filter on this process (and what it execs); it cannot be removed."""
    prog = build_program(spec)
    code = b"".join(struct.pack("HBBI", *insn) for insn in prog)
    buffer = ctypes.create_string_buffer(code)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog), ctypes.addressof(buffer))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) or libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER,
                                                                   ctypes.byref(fprog)):
        raise OSError(ctypes.get_errno(), "cannot install the seccomp filter")


def wrap(spec: SeccompSpec, spec_path: str, argv: list[str]) -> list[str]:
    """The argv that runs `argv` under `spec` (written to `spec_path`)."""
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(asdict(spec), f)
    return [sys.executable, os.path.abspath(__file__), spec_path, *argv]


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = SeccompSpec(**json.load(f))
    install(spec)
    os.execvp(sys.argv[2], sys.argv[2:])


if __name__ == "__main__":
    main()
