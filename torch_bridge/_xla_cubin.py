"""The machine code XLA compiled for a JAX function's Pallas kernels.

`jax.jit` compiles a Pallas kernel's Triton IR with the Triton fork and the
ptxas built into XLA; pip Triton compiles the same IR to different machine
code. For the backward's dK/dV and dQ kernels XLA's code is the faster one
(B1 H16 S4096 D128 causal on the H200: 0.560 ms against 0.611 ms;
benchmarks/results/h200/xla-cubin-2026-12-04). So the torch bridge's direct
launch (`torch_bridge._direct`) can launch XLA's cubin itself, on torch's
stream, instead of pip Triton's compile: the very kernels `jax.jit` runs,
with JAX's speed and JAX's bits.

How: the function is compiled by XLA for the GPU (what `jax.jit` does on
its first call), the executable is serialised (`jax.experimental.
serialize_executable`), and the CUDA ELF images (cubins) inside the bytes
are found and searched for the kernels by name. Nothing here depends on the
serialised format beyond "the cubins are stored whole, or in Snappy-compressed
Riegeli records" (jaxlib 0.11.2's format): when no image holds a kernel,
the caller keeps pip Triton's compile.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import struct
import tempfile

_ELF_MAGIC = b"\x7fELF"
_EM_CUDA = 190
_SHT_SYMTAB = 2
_SHT_NOBITS = 8
_STT_FUNC = 2


def _elf_size(blob: bytes, at: int) -> int | None:
  """Bytes of the 64-bit little-endian CUDA ELF image starting at `at`, or
  None if it is not one (or runs past the blob)."""
  if len(blob) < at + 64 or blob[at + 4] != 2 or blob[at + 5] != 1:
    return None
  (machine,) = struct.unpack_from("<H", blob, at + 0x12)
  if machine != _EM_CUDA:
    return None
  (shoff,) = struct.unpack_from("<Q", blob, at + 0x28)
  shentsize, shnum = struct.unpack_from("<HH", blob, at + 0x3A)
  if shentsize != 64 or shnum == 0:
    return None
  end = shoff + shnum * shentsize
  if at + end > len(blob):
    return None
  (phoff,) = struct.unpack_from("<Q", blob, at + 0x20)
  phentsize, phnum = struct.unpack_from("<HH", blob, at + 0x36)
  if phnum:
    end = max(end, phoff + phnum * phentsize)
    for i in range(phnum):
      h = at + phoff + i * phentsize
      if h + 56 > len(blob):
        return None
      off, _, _, filesz = struct.unpack_from("<QQQQ", blob, h + 8)
      end = max(end, off + filesz)
  for i in range(shnum):
    h = at + shoff + i * shentsize
    (sh_type,) = struct.unpack_from("<I", blob, h + 4)
    off, size = struct.unpack_from("<QQ", blob, h + 0x18)
    if sh_type != _SHT_NOBITS:
      end = max(end, off + size)
  return end if at + end <= len(blob) else None


_RIEGELI_SIGNATURE = b"\x83\xaf\x70\xd1\x0d\x88\x4a\x3f"
_RIEGELI_BLOCK = 1 << 16  # a 24-byte block header starts every 64 KiB
_RIEGELI_BLOCK_HEADER = 24


def _varint(b: bytes, i: int) -> tuple[int, int]:
  r = s = 0
  while True:
    c = b[i]
    i += 1
    r |= (c & 0x7F) << s
    s += 7
    if not c & 0x80:
      return r, i
    if s > 35:
      raise ValueError("varint too long")


def _snappy(b: bytes, i: int) -> tuple[bytes, int]:
  """The Snappy block (raw format) starting at b[i]: (bytes, end index);
  ValueError/IndexError where b[i:] is not one."""
  n, i = _varint(b, i)
  out = bytearray()
  while len(out) < n:
    t = b[i]
    i += 1
    kind = t & 3
    if kind == 0:  # literal
      length = t >> 2
      if length >= 60:
        nb = length - 59
        length = int.from_bytes(b[i:i + nb], "little")
        i += nb
      length += 1
      if i + length > len(b):
        raise ValueError("literal past the end")
      out += b[i:i + length]
      i += length
      continue
    if kind == 1:
      length, off = ((t >> 2) & 7) + 4, ((t >> 5) << 8) | b[i]
      i += 1
    elif kind == 2:
      length, off = (t >> 2) + 1, int.from_bytes(b[i:i + 2], "little")
      i += 2
    else:
      length, off = (t >> 2) + 1, int.from_bytes(b[i:i + 4], "little")
      i += 4
    if not 0 < off <= len(out):
      raise ValueError("copy before the start")
    for _ in range(length):
      out.append(out[-off])
  if len(out) != n:
    raise ValueError("length mismatch")
  return bytes(out), i


def _unpacked(blob: bytes, depth: int = 0):
  """blob, then (recursively) the Snappy-compressed contents of the Riegeli
  files in it: how PJRT stores a serialised GPU executable (jaxlib 0.11:
  an outer Riegeli file holding the executable proto, whose kernels' cubins
  sit in an inner one)."""
  yield blob
  if depth >= 4:
    return
  r = blob.find(_RIEGELI_SIGNATURE)
  while r >= 0:
    body = blob[r:]
    flat = b"".join(body[k + _RIEGELI_BLOCK_HEADER:k + _RIEGELI_BLOCK]
                    for k in range(0, len(body), _RIEGELI_BLOCK))
    s = 0
    while s < len(flat):
      try:
        out, end = _snappy(flat, s)
      except (ValueError, IndexError):
        s += 1
        continue
      if len(out) < 64:
        s += 1
        continue
      yield from _unpacked(out, depth + 1)
      s = end
    r = blob.find(_RIEGELI_SIGNATURE, r + 1)


def elf_images(blob: bytes) -> list[bytes]:
  """The CUDA ELF images (cubins) stored whole in `blob`."""
  out, at = [], blob.find(_ELF_MAGIC)
  while at >= 0:
    size = _elf_size(blob, at)
    if size:
      out.append(bytes(blob[at:at + size]))
      at = blob.find(_ELF_MAGIC, at + size)
    else:
      at = blob.find(_ELF_MAGIC, at + 1)
  return out


def functions(elf: bytes) -> list[str]:
  """Names of the function symbols (kernels and device functions) an ELF
  image defines."""
  (shoff,) = struct.unpack_from("<Q", elf, 0x28)
  _, shnum = struct.unpack_from("<HH", elf, 0x3A)
  heads = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + 64 * i)
           for i in range(shnum)]
  names = []
  for _, sh_type, _, _, off, size, link, _, _, entsize in heads:
    if sh_type != _SHT_SYMTAB or not entsize:
      continue
    str_off = heads[link][4]
    for j in range(size // entsize):
      st_name, st_info, _, shndx, _, _ = struct.unpack_from(
          "<IBBHQQ", elf, off + j * entsize)
      if st_info & 0xF == _STT_FUNC and shndx:
        end = elf.index(b"\0", str_off + st_name)
        names.append(elf[str_off + st_name:end].decode())
  return names


@dataclasses.dataclass(frozen=True)
class XlaKernel:
  """One kernel of an XLA GPU executable: the cubin holding it and how XLA
  launches it (grid, threads per block, dynamic shared memory bytes)."""

  name: str
  cubin: bytes
  grid: tuple[int, int, int]
  threads: int
  shared: int


_THUNK_LINE = re.compile(
    r"\b([\w$.]+) grid: \[(\d+), (\d+), (\d+)\] threads: "
    r"\[(\d+), 1, 1\]\s+shared_memory: (\d+) bytes")


def _launch_dims(dump_dir: str) -> dict:
  """{kernel: (grid, threads, shared bytes)} from XLA's thunk-sequence dump."""
  dims = {}
  for path in glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt")):
    with open(path) as f:
      for m in _THUNK_LINE.finditer(f.read()):
        g = tuple(int(x) for x in m.group(2, 3, 4))
        dims.setdefault(m.group(1), (g, int(m.group(5)), int(m.group(6))))
  return dims


def xla_kernels(fn, args, names) -> dict[str, XlaKernel]:
  """Those of the kernels `names` that XLA's GPU executable of jitted `fn`
  at `args` (ShapeDtypeStructs or None) holds, with XLA's launch dimensions
  (read from the compile's thunk dump; a kernel without them is left out)."""
  from jax.experimental import serialize_executable
  with tempfile.TemporaryDirectory(prefix="foldax_xla_") as dump:
    compiled = fn.trace(*args).lower().compile(
        compiler_options={"xla_dump_to": dump})
    dims = _launch_dims(dump)
  blob, _, _ = serialize_executable.serialize(compiled)
  found = {}
  images = [elf for part in _unpacked(blob) for elf in elf_images(part)]
  for elf in images:
    have = set(functions(elf))
    for n in names:
      if n in have and n in dims and n not in found:
        grid, threads, shared = dims[n]
        found[n] = XlaKernel(n, elf, grid, threads, shared)
  return found


_EIATTR_KPARAM_INFO = 0x17
_EIFMT_SIZES = {1: 2, 2: 2, 3: 2}  # entries are 4-byte aligned; 4: sized


def _sections(elf: bytes):
  (shoff,) = struct.unpack_from("<Q", elf, 0x28)
  _, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
  heads = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + 64 * i)
           for i in range(shnum)]
  names_off = heads[shstrndx][4]
  for h in heads:
    end = elf.index(b"\0", names_off + h[0])
    yield elf[names_off + h[0]:end].decode(), h


def param_layout(elf: bytes, kernel: str) -> list[tuple[int, int, int]]:
  """The kernel's parameters as (ordinal, byte offset, byte size), from its
  `.nv.info.<kernel>` section (empty if there is none): two compiles of one
  kernel signature must agree on it to share a launcher."""
  params = []
  for name, h in _sections(elf):
    if name != f".nv.info.{kernel}":
      continue
    off, size = h[4], h[5]
    at, end = off, off + size
    while at + 2 <= end:
      fmt, attr = elf[at], elf[at + 1]
      at += 2
      if fmt == 4:
        (n,) = struct.unpack_from("<H", elf, at)
        at += 2
        if attr == _EIATTR_KPARAM_INFO and n >= 12:
          _, ordinal, p_off, info = struct.unpack_from("<IHHI", elf, at)
          params.append((ordinal, p_off, (info >> 18) & 0x3FFF))
        at += n
      elif fmt in _EIFMT_SIZES:
        at += _EIFMT_SIZES[fmt]
      else:
        return []
  return sorted(params)
