"""What fsdpzero trusts in a checkpoint directory, and how it checks the rest.

DCP keeps its index (`.metadata`) as a pickle, and torch's FileSystemReader reads it with plain `pickle.load`: a
planted file would run code as soon as it is loaded. `SafeFileSystemReader` reads it whole into memory, walks its
opcodes first without running any (`_prescan`: only the opcodes DCP's metadata needs, every claimed length within
the bytes that remain, so nothing is allocated from a claim), then reads it with an unpickler that rebuilds
only what DCP's metadata contains (`METADATA_GLOBALS`: its dataclasses, torch.Size, dtypes, layouts, the
memory-format enum, paths): each object-making opcode is checked (`_MetadataUnpickler`), so no builtin is reachable
(nothing larger than the file is made) and no state is set on anything but the instances the index itself made (not
on a class, an enum member or another shared object: no process poisoning). Anything else is an
`UnsafeCheckpointError` naming the file and what was refused; the index is then checked before DCP acts on it
(`_check_entries`: sizes, dtypes, chunks inside the tensor covering it exactly once, byte ranges inside plain files
of the same directory). DCP reads tensor data itself with torch.load(weights_only=True);
a non-tensor ("bytes") entry DCP would read with torch.load(weights_only=False), so `SafeLoadPlanner` refuses those
(fsdpzero never writes them: non-tensor state goes to JSON).

Checksums: `ChecksumWriter` computes each data file's CRC-32 from the bytes as DCP writes them (no second read) and
leaves them in a side file per rank; fsdpzero.checkpoint.files puts every file's CRC-32 into the manifest, and
`checksum_problems` recomputes them on load. CRC-32 detects corruption (flipped bits, a torn copy), not tampering:
whoever can rewrite a file can rewrite the manifest too. Trust comes from the readers above, not from the checksums.
"""
from __future__ import annotations

import collections
import io
import json
import math
import pathlib
import pickle
import pickletools
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                  StorageMeta, TensorProperties, TensorStorageMetadata)

METADATA_FILE = ".metadata"
CRC_SIDE_PREFIX = ".crc-"     # a rank's data-file checksums, left in the temp dir until the manifest takes them
_CHUNK = 8 << 20


class UnsafeCheckpointError(pickle.UnpicklingError, ValueError):
    """A checkpoint file asked to unpickle something that is not on the allowlist (nothing from it was run). A
    ValueError too: a bad input file, which the CLI reports in one line."""


_DCP_MD = "torch.distributed.checkpoint.metadata"
# What a DCP .metadata really contains (pickle protocol 4/5, as DCP writes it): its dataclasses, made by NEWOBJ with
# no arguments and then filled by BUILD; torch.Size, layouts (by name) and the memory-format enum, made by REDUCE
# from a tuple of plain values; dtypes and pathlib paths (a StorageMeta.checkpoint_id) named directly.
METADATA_CLASSES = {(_DCP_MD, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                           "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata")} \
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
METADATA_CALLABLES = {("torch", "Size"), ("torch.serialization", "_get_layout"), (_DCP_MD, "_MEM_FORMAT_ENCODING"),
                      ("collections", "OrderedDict"),
                      *((m, n) for m in ("pathlib", "pathlib._local") for n in ("Path", "PosixPath", "PurePosixPath",
                                                                                "WindowsPath", "PureWindowsPath"))}
METADATA_GLOBALS = METADATA_CLASSES | METADATA_CALLABLES
_PLAIN = (str, int, float, bool, type(None), bytes)

# The opcodes of binary pickles (protocols 2 to 5) that plain values, containers, memo references and the checked
# object opcodes need: what DCP writes, plus their longer-length twins. Not here: protocol-5 out-of-band buffers and
# BYTEARRAY8 (DCP never writes them; the pure unpickler allocates a BYTEARRAY8's claimed length before reading it:
# 12 bytes asked for 512 MiB), persistent ids, the extension registry, INST/OBJ/NEWOBJ_EX, protocol-0 text opcodes.
METADATA_OPCODES = frozenset({
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP",
    "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "LONG4", "BINFLOAT",
    "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST", "LIST", "APPEND", "APPENDS",
    "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS",
    "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET",
    "GLOBAL", "STACK_GLOBAL", "NEWOBJ", "REDUCE", "BUILD"})


def _prescan(data: bytes, source: Path) -> None:
    """Walk the pickle's opcodes without running any (pickletools.genops over the bytes in memory) before the
    unpickler sees them: every opcode must be in METADATA_OPCODES, and every length an opcode claims (a string's,
    a frame's) must fit in the bytes that remain, so that nothing is allocated from a claimed length."""
    try:
        for op, arg, pos in pickletools.genops(data):   # a length past the end: ValueError before any allocation
            if op.name not in METADATA_OPCODES:
                raise UnsafeCheckpointError(
                    f"{source}: refused opcode {op.name} at byte {pos}: a DCP checkpoint index holds only DCP "
                    f"metadata, torch.Size, dtypes and containers; the file is corrupt or was planted, nothing from it "
                    f"was run")
            if op.name == "FRAME" and arg > len(data) - pos - 9:
                raise ValueError(f"a frame of {arg} bytes at byte {pos}, {len(data) - pos - 9} remain")
    except UnsafeCheckpointError:
        raise
    except Exception as e:   # truncated, an unknown opcode, a length larger than the file
        raise UnsafeCheckpointError(f"{source}: not a readable DCP checkpoint index ({type(e).__name__}: {e}); "
                                    f"nothing from it was run") from None


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler with its object-making opcodes checked, so that nothing outside DCP's metadata is
    built and nothing shared is changed:
    - NEWOBJ only on the DCP metadata dataclasses, with no arguments (a fresh, empty instance);
    - REDUCE only on torch.Size, the layout lookup, the memory-format enum, OrderedDict and pathlib paths, with
      arguments that are plain values or tuples of them (nothing built from them is larger than the file: no
      builtins such as bytes(N) or str(...) are reachable);
    - BUILD (set state) only on an instance this load made by NEWOBJ: never on a class, an enum member, a dtype or
      layout singleton, or any other object shared with the rest of the process (an 8-opcode BUILD on
      `_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT` poisoned every later DCP save);
    - INST / OBJ / NEWOBJ_EX (protocol 0/1 and keyword constructors, which DCP never writes) and persistent ids are
      refused."""

    def __init__(self, file, source: Path):
        super().__init__(file)
        self.source = source
        self.fresh: set[int] = set()    # ids of the instances NEWOBJ made in this load (BUILD may fill those only)
        self.keep: list = []            # ... kept alive so that their ids stay theirs

    def refuse(self, what: str):
        raise UnsafeCheckpointError(f"{self.source}: refused {what}: a DCP checkpoint index holds only DCP "
                                    f"metadata, torch.Size, dtypes and containers; the file is corrupt or was planted, "
                                    f"nothing from it was run")

    def load_newobj(self):
        args = self.stack.pop()
        cls = self.stack.pop()
        if not any(cls is self.find_class(*k) for k in METADATA_CLASSES):
            self.refuse(f"to construct {cls!r} by NEWOBJ")
        if args != ():
            self.refuse(f"arguments {args!r} to {cls.__name__}")
        obj = cls.__new__(cls)
        self.fresh.add(id(obj))
        self.keep.append(obj)
        self.append(obj)

    def load_reduce(self):
        args = self.stack.pop()
        func = self.stack[-1]
        if not any(func is self.find_class(*k) for k in METADATA_CALLABLES):
            self.refuse(f"to call {func!r}")
        if not isinstance(args, tuple) or not all(
                isinstance(a, _PLAIN) or isinstance(a, tuple) and all(isinstance(x, _PLAIN) for x in a)
                for a in args):
            self.refuse(f"arguments of types {[type(a).__name__ for a in args]} to {func!r}")
        self.stack[-1] = func(*args)

    def load_build(self):
        state = self.stack[-1]
        inst = self.stack[-2]
        if id(inst) not in self.fresh:
            self.refuse(f"to set state on {inst!r} (only DCP metadata instances made by this index are filled)")
        if isinstance(state, dict) and not all(isinstance(k, str) and not k.startswith("__") for k in state):
            self.refuse(f"state keys {[k for k in state if not isinstance(k, str) or k.startswith('__')]!r}")
        if not isinstance(state, (dict, tuple)):
            self.refuse(f"state of type {type(state).__name__} for {type(inst).__name__}")
        return super().load_build()

    def load_refused(self):
        self.refuse("an INST/OBJ/NEWOBJ_EX opcode (DCP writes protocol 4 NEWOBJ only)")

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.BUILD[0]] = load_build
    for _op in (pickle.INST, pickle.OBJ, pickle.NEWOBJ_EX):
        dispatch[_op[0]] = load_refused

    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_GLOBALS:
            if module.startswith("pathlib"):
                return getattr(pathlib, name)
            if module == "collections":
                return collections.OrderedDict
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.source}: refused to unpickle {module}.{name}: a DCP checkpoint index holds only DCP metadata, "
            f"torch.Size, dtypes and containers; the file is corrupt or was planted, nothing from it was run")

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(f"{self.source}: refused a persistent id in a DCP checkpoint index")


def read_dcp_metadata(path: str | Path, name: str = METADATA_FILE) -> Metadata:
    """<path>/.metadata through the allowlisted unpickler, checked: a Metadata whose entries live in plain files of
    <path>. Raises UnsafeCheckpointError (one line, naming the file) otherwise."""
    source = Path(path) / name
    try:
        with open(source, "rb") as f:   # read whole: a file object's read(n) allocates the n a length opcode
            data = f.read()              # claims (a 20-byte index asked for 3 GiB); BytesIO returns what is there
        _prescan(data, source)
        md = _MetadataUnpickler(io.BytesIO(data), source).load()
    except UnsafeCheckpointError:
        raise
    except FileNotFoundError:
        raise FileNotFoundError(f"{source} does not exist: not a DCP checkpoint directory") from None
    except Exception as e:   # truncated or garbage: a clear line instead of an unpickler traceback
        raise UnsafeCheckpointError(f"{source}: not a readable DCP checkpoint index ({type(e).__name__}: {e})") \
            from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise UnsafeCheckpointError(f"{source}: holds a {type(md).__name__}, not DCP Metadata")
    storage = md.storage_data if md.storage_data is not None else {}
    if not isinstance(storage, dict):
        raise UnsafeCheckpointError(f"{source}: storage_data is a {type(storage).__name__}, not a dict")
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not _plain_file_name(rel):
            raise UnsafeCheckpointError(f"{source}: an entry is stored in {rel!r}, which is not a file of {path}")
    _check_entries(md, storage, source, Path(path))
    return md


MAX_EMPTY_CHUNKS = 1 << 17   # empty shards of one tensor (ranks that hold none of it): one per rank at most
_OVERLAP_BUDGET = 1 << 21     # chunk pairs compared for a layout that is not a grid, before the index is refused


def _check_entries(md: Metadata, storage: dict, source: Path, directory: Path) -> None:
    """The index's entries as DCP will use them: each tensor a torch.Size of non-negative ints and a dtype, its
    chunks inside it, not overlapping and covering it exactly (a chunk listed K times made DCP read the tensor K
    times: 2 bytes of index per extra copy), each non-empty chunk with a storage entry; each storage entry a
    byte range inside its data file. One error line naming the file and the entry."""
    def bad(key, what):
        raise UnsafeCheckpointError(f"{source}: entry {key!r}: {what}; the index is corrupt or was planted")

    def shape(value):
        return isinstance(value, torch.Size) and all(type(n) is int and n >= 0 for n in value)

    file_sizes: dict[str, int] = {}
    for index, info in storage.items():
        fqn, rel = getattr(index, "fqn", index), info.relative_path
        if type(getattr(info, "offset", None)) is not int or type(getattr(info, "length", None)) is not int \
                or info.offset < 0 or info.length < 0:
            bad(fqn, f"storage offset {getattr(info, 'offset', None)!r} and length "
                     f"{getattr(info, 'length', None)!r} in {rel} are not non-negative integers")
        if rel not in file_sizes:
            try:
                file_sizes[rel] = (directory / rel).stat().st_size
            except OSError as e:
                bad(fqn, f"its data file {rel} cannot be read ({e.strerror or e})")
        if info.offset + info.length > file_sizes[rel]:
            bad(fqn, f"stored at bytes {info.offset}..{info.offset + info.length} of {rel}, past the end of the "
                     f"file ({file_sizes[rel]} bytes)")
    keys_with_storage = {getattr(index, "fqn", None) for index in storage}
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str):
            bad(key, "the key is not a string")
        if isinstance(entry, BytesStorageMetadata):
            if key not in keys_with_storage:
                bad(key, "no storage entry for it")
            continue
        if not isinstance(entry, TensorStorageMetadata):
            bad(key, f"a {type(entry).__name__}, neither a tensor nor a bytes entry")
        size = getattr(entry, "size", None)
        if not shape(size):
            bad(key, f"size {size!r} is not a torch.Size of non-negative integers")
        props = getattr(entry, "properties", None)
        if not isinstance(props, TensorProperties) or not isinstance(getattr(props, "dtype", None), torch.dtype) \
                or getattr(props, "layout", None) is not torch.strided:
            bad(key, f"properties {props!r} do not name a dtype and the strided layout")
        chunks = getattr(entry, "chunks", None)
        if not isinstance(chunks, list):
            bad(key, f"chunks {type(chunks).__name__}, not a list")
        boxes, empty = [], 0
        for chunk in chunks:
            offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
            if not isinstance(chunk, ChunkStorageMetadata) or not shape(offsets) or not shape(sizes) \
                    or len(offsets) != len(size) or len(sizes) != len(size) \
                    or any(o + n > d for o, n, d in zip(offsets, sizes, size)):
                bad(key, f"chunk {chunk!r} is not inside the tensor's size {tuple(size)}")
            if math.prod(sizes) == 0:
                empty += 1
                if empty > MAX_EMPTY_CHUNKS:
                    bad(key, f"more than {MAX_EMPTY_CHUNKS} empty chunks")
                continue
            if MetadataIndex(key, offsets) not in storage:
                bad(key, f"no storage entry for its chunk at offsets {tuple(offsets)}")
            boxes.append((tuple(offsets), tuple(sizes)))
        covered = sum(math.prod(n) for _, n in boxes)
        overlap = _overlap(boxes)
        if overlap:
            bad(key, overlap)
        if covered != math.prod(size):
            bad(key, f"its chunks hold {covered} elements, the tensor {tuple(size)} has {math.prod(size)}")


def _overlap(boxes: list) -> str | None:
    """What overlaps among the (offsets, sizes) boxes, or None. A sharded tensor's chunks form a grid (each dim cut
    into intervals that are disjoint or equal): then two overlap only if they are the same box, a set lookup. Any
    other layout: a sweep along dim 0, comparing only boxes whose dim-0 ranges meet, within a budget."""
    ndim = len(boxes[0][0]) if boxes else 0
    grid = True
    for d in range(ndim):
        spans = sorted({(o[d], o[d] + n[d]) for o, n in boxes})
        if any(b[0] < a[1] for a, b in zip(spans, spans[1:])):
            grid = False
            break
    if grid:
        seen = {}
        for o, n in boxes:
            if (o, n) in seen:
                return f"its chunk at offsets {o} (sizes {n}) is listed more than once"
            seen[(o, n)] = o
        return None
    active, budget = [], _OVERLAP_BUDGET
    for o, n in sorted(boxes):
        active = [(a, m) for a, m in active if a[0] + m[0] > o[0]]
        budget -= len(active)
        if budget < 0:
            return f"{len(boxes)} chunks in a layout too irregular to check for overlaps"
        for a, m in active:
            if all(a[d] < o[d] + n[d] and o[d] < a[d] + m[d] for d in range(ndim)):
                return f"its chunks at offsets {a} and {o} overlap"
        active.append((o, n))
    return None


def _plain_file_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose read_metadata goes through read_dcp_metadata instead of pickle.load."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        md = read_dcp_metadata(Path(self.path), METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that refuses non-tensor entries (DCP unpickles them with weights_only=False)."""

    def load_bytes(self, read_item, value) -> None:
        raise UnsafeCheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is stored as pickled bytes, "
                                    f"which fsdpzero never writes and does not unpickle; nothing from it was run")


def tensor_entries(md: Metadata, path: Path, keys) -> None:
    """Refuse before loading if one of `keys` is not a tensor entry of the checkpoint index."""
    for key in keys:
        entry = md.state_dict_metadata.get(key)
        if entry is not None and not isinstance(entry, TensorStorageMetadata):
            raise UnsafeCheckpointError(f"{path / METADATA_FILE}: entry {key!r} is {type(entry).__name__}, not a "
                                        f"tensor; fsdpzero does not unpickle checkpoint entries")


# ---- checksums --------------------------------------------------------------------------------------------------

def crc_text(crc: int) -> str:
    return f"crc32:{crc & 0xFFFFFFFF:08x}"


def file_crc(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc_text(crc)


class _CrcStream:
    """A file DCP writes into, hashed as it goes (DCP only appends)."""

    def __init__(self, raw):
        self.raw, self.crc = raw, 0

    def write(self, b) -> int:
        self.crc = zlib.crc32(b, self.crc)   # releases the GIL on large buffers: writer threads overlap
        return self.raw.write(b)

    def writable(self) -> bool:
        return True

    def __getattr__(self, name):             # tell, fileno, flush, close
        return getattr(self.raw, name)


class _CrcFileSystem(FileSystem):
    def __init__(self):
        super().__init__()
        self.crcs: dict[str, str] = {}
        self.errors: list[BaseException] = []

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode or not str(path).endswith(".distcp"):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        try:
            with super().create_stream(path, mode) as stream:
                hashed = _CrcStream(stream)
                yield hashed
        except BaseException as e:
            self.errors.append(e)   # DCP's extra writer threads drop their exceptions: write_data re-raises it
            raise
        self.crcs[Path(path).name] = crc_text(hashed.crc)


class ChecksumWriter(FileSystemWriter):
    """FileSystemWriter that leaves the CRC-32 of each data file it wrote in <dir>/.crc-<prefix>json, and fails
    the save when a writer thread failed (torch's writer threads die silently, e.g. on a full disk, and the save
    would report success with entries missing)."""

    def __init__(self, path, **kwargs):
        super().__init__(path, **kwargs)
        self.fs = _CrcFileSystem()

    def write_data(self, plan, planner):
        try:
            fut = super().write_data(plan, planner)
            results = fut.wait()   # torch's writer has finished its files when write_data returns anyway
        except Exception as e:
            self.fs.errors.insert(0, e)
        if self.fs.errors:
            raise _underlying_os_error(self.fs.errors[0])
        if len(results) != len(plan.items):
            raise OSError(f"checkpoint writer wrote {len(results)} of {len(plan.items)} entries to {self.path}: a "
                          f"writer thread failed")
        prefix = getattr(plan.storage_data, "prefix", "__0_")
        side = Path(self.path) / f"{CRC_SIDE_PREFIX}{prefix.strip('_')}.json"
        mine = {name: crc for name, crc in self.fs.crcs.items() if name.startswith(prefix)}
        side.write_text(json.dumps(mine))
        return fut


def _underlying_os_error(e: BaseException) -> BaseException:
    """torch.save reports a full disk as "unexpected pos" with the OSError as its context, which DCP loses when it
    sends the exception to the other ranks (pickled: args only). The OSError itself, rebuilt from its fields."""
    seen, cause = set(), e
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError):
            return OSError(cause.errno, cause.strerror, cause.filename) if cause.errno else cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return e


def collect_side_checksums(tmp: Path) -> dict[str, str]:
    """The ranks' side files merged (and removed): data file name -> checksum."""
    out: dict[str, str] = {}
    for side in sorted(tmp.glob(f"{CRC_SIDE_PREFIX}*.json")):
        out.update(json.loads(side.read_text()))
        side.unlink()
    return out


def checksum_problems(path: Path, checksums: dict[str, str], rank: int = 0, world: int = 1) -> list[str]:
    """This rank's share of the files (every world-th) re-hashed and compared with the manifest."""
    problems = []
    for i, (name, want) in enumerate(sorted(checksums.items())):
        if i % world != rank:
            continue
        got = file_crc(path / name)
        if got != want:
            problems.append(f"{path / name} does not match its checksum in the manifest ({got}, saved {want}): "
                            f"the file is corrupt or was changed after the save")
    return problems
