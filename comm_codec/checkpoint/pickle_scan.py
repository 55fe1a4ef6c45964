"""Read a torch pickle without running it: which storage holds which dtype, under which name.

``torch.save`` writes a zip whose ``data.pkl`` describes the object tree and points at
storages (``data/<key>`` records) by persistent id; a legacy (non-zip) ``torch.save``
file's object pickle does the same, its storages following the pickles. :func:`scan_torch_pickle` parses the
opcodes with :mod:`pickletools` and runs a *symbolic* stack machine over them: strings,
numbers, tuples, dicts and global *names* are tracked; nothing is imported or called.
"""

from __future__ import annotations

import math
import pickletools

__all__ = ["scan_torch_pickle", "MAX_OPS"]

# Opcodes scanned at most. Each one makes at most one small object, so this bounds the
# scanner's memory (~200 MB at worst) and time; torch.save spends ~25 per tensor,
# so 80 000 tensors fit. A bigger pickle is not understood: its storages stay opaque.
MAX_OPS = 2_000_000
# A tensor deeper than this many keys is named after its storage, not its path.
_MAX_NAME_DEPTH = 64
# Objects walked when naming storages.
_MAX_WALK = 1_000_000
# State-dict entries listed per storage (views and tied weights share one).
MAX_ENTRIES = 1024


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= 1 << 62


class _G:
    """A reference to a global (module, name), never imported."""

    __slots__ = ("module", "name")

    def __init__(self, module, name):
        self.module, self.name = module, name


class _Obj:
    """Whatever a REDUCE/NEWOBJ would have built: only its pieces are kept."""

    __slots__ = ("func", "args", "items", "state")

    def __init__(self, func, args):
        self.func, self.args, self.items, self.state = func, args, [], None


class _Pair:
    """One dict entry (key, value)."""

    __slots__ = ("key", "value")

    def __init__(self, key, value):
        self.key, self.value = key, value


class _Storage:
    __slots__ = ("key", "dtypes", "numel", "typed", "name", "shape", "entries")

    def __init__(self, key, numel):
        self.key, self.numel, self.dtypes, self.typed, self.name, self.shape = key, numel, set(), None, None, None
        self.entries = []


class _TensorRef:
    __slots__ = ("storage", "size")

    def __init__(self, storage, size):
        self.storage, self.size = storage, size


_UNKNOWN = object()
_STORAGE_TYPES = {
    "BFloat16Storage": "bfloat16",
    "HalfStorage": "float16",
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
}
_REBUILD = {"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3"}
_PUSH_ARG = {
    "INT",
    "BININT",
    "BININT1",
    "BININT2",
    "LONG",
    "LONG1",
    "LONG4",
    "FLOAT",
    "BINFLOAT",
    "STRING",
    "BINSTRING",
    "SHORT_BINSTRING",
    "BINBYTES",
    "SHORT_BINBYTES",
    "BINBYTES8",
    "BYTEARRAY8",
    "UNICODE",
    "BINUNICODE",
    "SHORT_BINUNICODE",
    "BINUNICODE8",
}
_CONSTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False, "EMPTY_TUPLE": ()}


def scan_torch_pickle(data: bytes, itemsize) -> dict:
    """Map each storage key of a torch pickle to (dtype or None, name, bytes, shape or None, entries).

    Args:
        data: the ``data.pkl`` bytes.
        itemsize: ``itemsize(dtype_name)`` -> bytes per element, or None for a dtype whose
            storages are to stay opaque.

    The pickle is *read*, never run: :func:`pickletools.genops` parses opcodes and a
    symbolic stack machine tracks strings, numbers, tuples, dicts and global *names*
    (no import, no call). A storage's dtype comes from its storage class
    (``torch.BFloat16Storage``...) or the dtype argument of ``_rebuild_tensor_v3``; a
    storage claimed with two dtypes gets None (coded as opaque bytes). A tensor's name
    is its path of dict keys from the root ("state.0.exp_avg"). ``entries`` lists
    ``[name, shape or None]`` of every tensor on a storage that several share (views, an
    LSTM's flattened weights, tied embeddings; at most :data:`MAX_ENTRIES`), else None.

    Raises:
        ValueError: more than :data:`MAX_OPS` opcodes.
        ValueError, IndexError, KeyError...: not a pickle this scanner understands.

    The caller (:mod:`.formats`) catches every error and codes the storages as opaque
    bytes, which is always exact: none of them reaches a user.
    """
    stack, marks, memo, storages = [], [], {}, {}
    root = None

    def pop_mark():
        k = marks.pop()
        items = stack[k:]
        del stack[k:]
        return items

    for count, (op, arg, _) in enumerate(pickletools.genops(data)):
        if count >= MAX_OPS:
            raise ValueError(f"pickle has more than {MAX_OPS} opcodes")
        name = op.name
        if name in _PUSH_ARG:
            stack.append(arg)
        elif name in _CONSTS:
            stack.append(_CONSTS[name])
        elif name in ("PROTO", "FRAME"):
            pass
        elif name == "STOP":
            root = stack.pop()
            break
        elif name == "MARK":
            marks.append(len(stack))
        elif name == "TUPLE":
            stack.append(tuple(pop_mark()))
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            items = tuple(stack[-n:])
            if len(items) != n:
                raise IndexError("stack underflow")
            del stack[-n:]
            stack.append(items)
        elif name in ("EMPTY_LIST", "EMPTY_DICT"):
            stack.append(_Obj(name, ()))
        elif name in ("LIST", "DICT"):
            o = _Obj(name, ())
            items = pop_mark()
            o.items = items if name == "LIST" else [_Pair(k, v) for k, v in zip(items[::2], items[1::2])]
            stack.append(o)
        elif name in ("APPEND", "SETITEM"):
            v = stack.pop()
            if name == "SETITEM":
                v = _Pair(stack.pop(), v)
            if isinstance(stack[-1], _Obj):
                stack[-1].items.append(v)
        elif name in ("APPENDS", "SETITEMS"):
            items = pop_mark()
            if name == "SETITEMS":
                items = [_Pair(k, v) for k, v in zip(items[::2], items[1::2])]
            if isinstance(stack[-1], _Obj):
                stack[-1].items.extend(items)
        elif name == "GLOBAL":
            module, _, qual = arg.partition(" ")
            stack.append(_G(module, qual))
        elif name == "STACK_GLOBAL":
            qual, module = stack.pop(), stack.pop()
            stack.append(_G(module, qual) if isinstance(module, str) and isinstance(qual, str) else _UNKNOWN)
        elif name in ("REDUCE", "NEWOBJ"):
            args, func = stack.pop(), stack.pop()
            stack.append(_reduce(func, args))
        elif name == "BUILD":
            state = stack.pop()
            if isinstance(stack[-1], _Obj):
                stack[-1].state = state
        elif name == "BINPERSID":
            stack.append(_persistent(stack.pop(), storages))
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = stack[-1]
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo[arg])
        elif name == "DUP":
            stack.append(stack[-1])
        elif name == "POP":
            if stack and (not marks or len(stack) > marks[-1]):
                stack.pop()
            else:
                pop_mark()
        elif name == "POP_MARK":
            pop_mark()
        else:  # anything else: apply its stack effect, its result is unknown
            before = op.stack_before
            if pickletools.markobject in before:
                pop_mark()
                n = before.index(pickletools.markobject)
            else:
                n = len(before)
            for _ in range(n):
                stack.pop()
            stack.extend(_UNKNOWN for _ in op.stack_after)
    _name_storages(root)
    out = {}
    for key, s in storages.items():
        dtype = next(iter(s.dtypes)) if len(s.dtypes) == 1 else None
        nbytes = shape = None
        size = itemsize(dtype) if dtype is not None else None
        if size:
            # A typed storage counts elements, an untyped one bytes.
            nbytes = s.numel * size if s.typed else s.numel
            if s.shape is not None and math.prod(s.shape) * size == nbytes:
                shape = list(s.shape)  # its first tensor spans the storage
        # Every entry on the storage, in the order found, where more than one shares it.
        out[key] = (dtype, s.name, nbytes, shape, s.entries if len(s.entries) > 1 else None)
    return out


def _persistent(pid, storages):
    # (storage, class, key, location, numel); a legacy file adds view metadata (None
    # unless the tensor is a view of a storage view, which has no layout this reads).
    if not (
        isinstance(pid, tuple)
        and len(pid) in (5, 6)
        and pid[0] == "storage"
        and isinstance(pid[1], _G)
        and isinstance(pid[2], str)
        and isinstance(pid[4], int)
        and (len(pid) == 5 or pid[5] is None)
    ):
        return _UNKNOWN
    s = storages.get(pid[2])
    if s is None:
        s = storages[pid[2]] = _Storage(pid[2], pid[4])
    typed = _STORAGE_TYPES.get(pid[1].name) if pid[1].module == "torch" else None
    if typed is not None:
        s.typed = typed
        s.dtypes.add(typed)
    elif pid[1].name != "UntypedStorage":
        s.dtypes.add(None)  # a storage class we do not know: ambiguous, opaque
    return s


def _reduce(func, args):
    if (
        isinstance(func, _G)
        and func.module == "torch._utils"
        and func.name in _REBUILD
        and isinstance(args, tuple)
        and args
        and isinstance(args[0], _Storage)
    ):
        storage = args[0]
        if func.name == "_rebuild_tensor_v3":
            dt = args[-1]
            storage.dtypes.add(dt.name if isinstance(dt, _G) and dt.module == "torch" else None)
        size = args[2] if len(args) > 2 and isinstance(args[2], tuple) else None
        return _TensorRef(storage, size if size is not None and all(_is_int(d) for d in size) else None)
    return _Obj(func, args)


def _name_storages(root) -> None:
    """Name each storage after the first path of dict keys that leads to a tensor on it.

    Paths are kept as links to their parent (key, parent) and joined only for a tensor,
    so deep nesting costs memory linear in the objects, not quadratic in the depth.
    """
    todo, seen = [(root, None, 0)], set()
    while todo:
        obj, path, depth = todo.pop()
        if isinstance(obj, _TensorRef):
            s = obj.storage
            name = _join(path, depth) or f"storage/{s.key}"
            if s.name is None:
                s.name, s.shape = name, obj.size
            if len(s.entries) < MAX_ENTRIES:
                s.entries.append([name, None if obj.size is None else list(obj.size)])
            continue
        if not isinstance(obj, (tuple, _Obj)) or id(obj) in seen:
            continue
        if len(seen) >= _MAX_WALK:
            return
        seen.add(id(obj))
        children = []
        if isinstance(obj, tuple):
            children = [
                (v, (str(i), path), depth + 1) for i, v in enumerate(obj) if isinstance(v, (tuple, _Obj, _TensorRef))
            ]
        else:
            for i, item in enumerate(obj.items):
                if isinstance(item, _Pair):
                    key = item.key if isinstance(item.key, (str, int)) else i
                    item, step = item.value, str(key)
                else:
                    step = str(i)
                if isinstance(item, (tuple, _Obj, _TensorRef)):
                    children.append((item, (step, path), depth + 1))
            children.append((obj.args, path, depth))
            children.append((obj.state, path, depth))
        todo.extend(reversed(children))


def _join(path, depth: int) -> str | None:
    """The dotted name of a linked path, or None when it is deeper than _MAX_NAME_DEPTH."""
    if depth > _MAX_NAME_DEPTH:
        return None
    parts = []
    while path is not None:
        step, path = path
        parts.append(step)
    return ".".join(reversed(parts))
