"""The public surface, pinned: every facade's names and signatures (like python-zstandard's test_module_attributes.py).

A change to what users can import, or to how they call it, shows here as a diff. Shared
helpers that are not for users stay out of ``__all__`` (importable from their modules,
not part of the surface). Regenerate a changed entry with ``describe`` below and say why
in the commit.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

pytestmark = pytest.mark.unit

MAX_PUBLIC_NAMES = 100


def describe(obj) -> str:
    """``class(<signature>)`` for a class, ``<signature>`` for a function, ``value`` for the rest."""
    if inspect.isclass(obj):
        try:
            return "class" + str(inspect.signature(obj))
        except (TypeError, ValueError):
            return "class(...)"
    if callable(obj):
        try:
            return str(inspect.signature(obj))
        except (TypeError, ValueError):
            return "(...)"
    return "value"


SURFACE = {
    "comm_codec": {
        "Codec": "class(codebooks: 'CodebookSet | None' = None, threads: 'int | None' = None, chunk_elems: 'int' = 16384, checksum: 'bool' = True, split_exponent: 'bool' = True)",
        "CommConfig": "class(*, codebooks: 'CodebookSet | str | os.PathLike | None' = None, warmup_steps: 'int' = 0, mode: 'str' = 'auto', cast: 'str | None' = None, min_bytes: 'int' = 4096, threads: 'int | None' = None, log_every: 'int' = 50, drift_every: 'int' = 0, refresh_threshold: 'float | None' = None, refresh_steps: 'int' = 3, recheck_every: 'int' = 200, probe_steps: 'int' = 4, hysteresis: 'float' = 0.05) -> None",
        "Codebook": "class(lengths, escape_length: 'int' = 0, raw: 'bool' = False)",
        "CodebookGroup": "class(books)",
        "CodebookSet": "class(books: 'dict | None' = None, meta: 'dict | None' = None, stats: 'dict | None' = None)",
        "CommCodecError": "class(...)",
        "CodebookError": "class(...)",
        "CheckpointError": "class(...)",
        "ChainError": "class(message: 'str', missing: 'str')",
        "CollectiveError": "class(...)",
        "AgreementError": "class(...)",
        "ConfigError": "class(key: 'str', value, allowed: 'str')",
        "FrameError": "class(...)",
        "KINDS": "value",
        "SUPPORTED_DTYPES": "value",
        "WarmupProfiler": "class(chunk_elems: 'int' = 16384, max_books: 'int' = 8, min_gain: 'float' = 0.001, max_rows: 'int' = 2048, wire_min_gain: 'float' = 0.1)",
        "get_frame_parameters": "(frame) -> 'FrameParameters'",
        "set_verbosity": "(level: 'str | int | None') -> 'None'",
        "__version__": "value",
    },
    "comm_codec.ddp": {
        "HuffmanState": "class(process_group=None, codebooks=None, warmup_steps: int = 0, *, config=None, writer=None, **options)",
        "huffman_hook": "(state: 'HuffmanState', bucket: torch._C._distributed_c10d.GradBucket) -> torch.jit.Future[torch.Tensor]",
    },
    "comm_codec.fsdp": {
        "FSDPState": "class(process_group=None, overlap: 'bool' = True, *, config=None, writer=None, **options)",
        "HuffmanReduceScatter": "class(state: 'FSDPState', name: 'str' = '<module>')",
        "HuffmanAllGather": "class(state: 'FSDPState', name: 'str' = '<module>')",
        "compress": "(model: 'nn.Module', *, process_group=None, config=None, overlap: 'bool' = True, writer=None, **options) -> 'FSDPState'",
        "register": "(model: 'nn.Module', *, process_group=None, config=None, overlap: 'bool' = True, writer=None, **options) -> 'FSDPState'",
    },
    "comm_codec.deepspeed": {
        "CommCodecConfig": "class(config: 'CommConfig', codebooks: 'str' = 'default', enabled: 'bool' = True, kinds: 'tuple[str, ...] | None' = None, monitor: 'bool' = True) -> None",
        "DEEPSPEED_ONLY": "value",
        "DeepSpeedState": "class(engine, config: 'CommCodecConfig', stage: 'int')",
        "SUPPORTED_DEEPSPEED": "value",
        "initialize": "(*args, **kwargs)",
        "install": "(engine, config=None) -> 'DeepSpeedState'",
        "parse_config": "(config) -> 'CommCodecConfig | None'",
        "register": "(engine, *, config: 'CommConfig | None' = None, kinds=None, monitor: 'bool' = True, **options) -> 'DeepSpeedState'",
        "stats": "(engine) -> 'TrafficStats'",
    },
    "comm_codec.dcp": {
        "FRAME_DESCRIPTOR": "value",
        "MAX_METADATA_BYTES": "value",
        "PACK_DESCRIPTOR": "value",
        "Reader": "class(path, *, codebooks=None, trusted: 'bool' = False)",
        "Writer": "class(path, *, codebooks=None, kind_of=None, single_file_per_rank: 'bool' = True, sync_files: 'bool' = True, thread_count: 'int' = 1, per_thread_copy_ahead: 'int' = 10000000, cache_staged_state_dict: 'bool' = False, force: 'bool' = False, overwrite: 'bool | None' = None, _extensions=None, serialization_format=<SerializationFormat.TORCH_SAVE: 'torch_save'>)",
        "kind_of": "(fqn: 'str') -> 'str'",
        "load": "(state_dict: 'dict', path, *, process_group=None, planner=None, codebooks=None, trusted: 'bool' = False) -> 'Summary'",
    },
    "comm_codec.collectives": {
        "CollectiveError": "class(...)",
        "CommStats": "class()",
        "Workspace": "class()",
        "all_reduce": "(tensor: 'torch.Tensor', codec: 'Codec | None' = None, group=None, *, average: 'bool' = False, kind: 'str' = 'gradient', reduced_kind: 'str' = 'reduced_gradient', cast=None, stats: 'CommStats | None' = None, workspace: 'Workspace | None' = None) -> 'torch.Tensor'",
        "reduce_scatter": "(output: 'torch.Tensor', input_list: 'list[torch.Tensor]', codec: 'Codec | None' = None, group=None, *, average: 'bool' = False, kind: 'str' = 'gradient', cast=None, stats: 'CommStats | None' = None, workspace: 'Workspace | None' = None) -> 'torch.Tensor'",
        "all_gather": "(tensor_list: 'list[torch.Tensor]', tensor: 'torch.Tensor', codec: 'Codec | None' = None, group=None, *, kind: 'str' = 'activation', stats: 'CommStats | None' = None, workspace: 'Workspace | None' = None) -> 'list[torch.Tensor]'",
        "send": "(tensor: 'torch.Tensor', dst: 'int', codec: 'Codec | None' = None, group=None, *, kind: 'str' = 'activation', stats: 'CommStats | None' = None) -> 'None'",
        "recv": "(tensor: 'torch.Tensor', src: 'int', codec: 'Codec | None' = None, group=None, *, stats: 'CommStats | None' = None) -> 'torch.Tensor'",
        "reduce": "(tensor: 'torch.Tensor', dst: 'int', codec: 'Codec | None' = None, group=None, *, cast=None, kind: 'str' = 'gradient', stats: 'CommStats | None' = None, workspace: 'Workspace | None' = None) -> 'None'",
        "row_parallel_all_reduce": "(x: 'torch.Tensor', codec: 'Codec | None' = None, group=None, stats: 'CommStats | None' = None) -> 'torch.Tensor'",
    },
    "comm_codec.checkpoint": {
        "CheckpointError": "class(...)",
        "Summary": "class(op: 'str', original_bytes: 'int', compressed_bytes: 'int', seconds: 'float', threads: 'int', format: 'str', tensors: 'int' = 0, coded: 'int' = 0, delta: 'int' = 0, digest: 'str | None' = None, note: 'str | None' = None) -> None",
        "compress_file": "(src, dst, *, base=None, threads: 'int | None' = None, codebooks=None, progress: 'bool | None' = None, force: 'bool' = False) -> 'Summary'",
        "decompress_file": "(src, dst, *, base=None, threads: 'int | None' = None, progress: 'bool | None' = None, force: 'bool' = False) -> 'Summary'",
        "verify_file": "(src, *, base=None, threads: 'int | None' = None, progress: 'bool | None' = None) -> 'Summary'",
        "compress_dir": "(src, dst, *, threads: 'int | None' = None, force: 'bool' = False, progress: 'bool | None' = None, on_file: 'Callable[[FileResult], None] | None' = None, codebooks=None, base=None) -> 'DirSummary'",
        "decompress_dir": "(src, dst, *, threads: 'int | None' = None, force: 'bool' = False, progress: 'bool | None' = None, on_file: 'Callable[[FileResult], None] | None' = None, base=None) -> 'DirSummary'",
        "verify_dir": "(src, *, threads: 'int | None' = None, progress: 'bool | None' = None, on_file: 'Callable[[FileResult], None] | None' = None) -> 'DirSummary'",
        "load_file": "(path, device: 'str' = 'cpu') -> 'dict'",
        "safe_open": "(path, framework: 'str' = 'pt', device: 'str' = 'cpu') -> 'CompressedTensors'",
        "read_index": "(path) -> 'dict'",
        "describe": "(path) -> 'str'",
        "is_checkpoint": "(path) -> 'bool'",
        "save": "(state_dict, path, *, base=None, threads: 'int | None' = None) -> 'Summary'",
        "load": "(path, *, base=None, threads: 'int | None' = None, map_location='cpu')",
        "MAGIC": "value",
        "LOSSY_MAGIC": "value",
        "VERSION": "value",
        "PIECE_BYTES": "value",
    },
    "comm_codec.checkpoint.lossy": {
        "ChainError": "class(message: 'str', missing: 'str')",
        "LossySummary": "class(op: 'str', method: 'str', original_bytes: 'int', compressed_bytes: 'int', seconds: 'float', format: 'str', lossy_tensors: 'int' = 0, errors: 'dict' = <factory>, notes: 'list' = <factory>, base: 'str | None' = None) -> None",
        "compress_file": "(src, dst, *, method: 'str' = 'excp', base=None, max_error: 'float | None' = None, bits: 'int | None' = None, alpha: 'float | None' = None, beta: 'float' = 2.0, keep_bits: 'int | None' = None, threads: 'int | None' = None, force: 'bool' = False) -> 'LossySummary'",
        "decompress_file": "(src, dst, *, base=None, threads: 'int | None' = None, beside=None, force: 'bool' = False) -> 'LossySummary'",
        "verify_file": "(src, *, base=None, threads: 'int | None' = None, beside=None) -> 'LossySummary'",
        "load": "(path, *, base=None, map_location='cpu')",
        "read_index": "(path) -> 'dict'",
        "describe": "(path) -> 'str'",
        "is_lossy": "(path) -> 'bool'",
        "clear_cache": "() -> 'None'",
        "METHODS": "value",
        "VERSION": "value",
        "DEFAULT_MAX_ERROR": "value",
        "DEFAULT_MOMENT_BITS": "value",
        "DEFAULT_BITS": "value",
        "DEFAULT_ALPHA": "value",
        "DEFAULT_BETA": "value",
    },
    "comm_codec.integrations": {
        "attach": "(model: 'nn.Module', **state_kwargs)",
        "register": "(model: 'nn.Module', **state_kwargs)",
    },
    "comm_codec.integrations.accelerate": {
        "register": "(accelerator, model, **state_kwargs)",
    },
    "comm_codec.integrations.hf": {
        "CommCodecCallback": "class(**state_kwargs)",
        "from_pretrained": "(model_class, folder, device: 'str' = 'cpu', **kwargs)",
        "load_state_dict": "(folder, device: 'str' = 'cpu') -> 'dict'",
    },
    "comm_codec.integrations.lightning": {
        "CommCodecCallback": "class(log_stats: 'bool' = True, **state_kwargs)",
    },
}


@pytest.mark.parametrize("module", sorted(SURFACE))
def test_module_names_and_signatures_are_pinned(module):
    if module == "comm_codec.deepspeed":
        pytest.importorskip("deepspeed")
    if module.endswith(".hf"):
        pytest.importorskip("transformers")
    if module.endswith(".lightning"):
        pytest.importorskip("lightning")
    mod = importlib.import_module(module)
    assert list(mod.__all__) == list(SURFACE[module]), f"{module}.__all__ changed"
    for name, expected in SURFACE[module].items():
        assert describe(getattr(mod, name)) == expected, f"{module}.{name} changed its signature"


def test_public_surface_is_small():
    assert sum(len(names) for names in SURFACE.values()) <= MAX_PUBLIC_NAMES


def test_old_names_are_aliases_of_the_new_ones():
    import comm_codec.fsdp
    import comm_codec.integrations

    assert comm_codec.fsdp.compress is comm_codec.fsdp.register
    assert comm_codec.integrations.attach is comm_codec.integrations.register
    assert comm_codec.fsdp.FSDPState.attach is comm_codec.fsdp.FSDPState.reattach


def test_every_state_reports_one_record_type():
    from comm_codec.comm.stats import TrafficStats
    from comm_codec.ddp import HuffmanState
    from comm_codec.fsdp import FSDPState

    ddp, fsdp = HuffmanState().stats(), FSDPState().stats()
    assert type(ddp) is type(fsdp) is TrafficStats
    assert [k for k in ddp] == [k for k in fsdp if k not in ("reduce_scatter", "all_gather")]
    assert ddp["bytes_in"] == 0 and ddp.as_dict()["steps"] == 0
    assert "steps" not in fsdp["all_gather"] and fsdp.collectives["all_gather"].calls == 0


def test_checkpoint_options_are_keyword_only_and_codebooks_take_a_path(tmp_path):
    import torch

    import comm_codec as cc
    from comm_codec import checkpoint

    src = tmp_path / "w.pt"
    torch.save({"w": torch.randn(64, 64).to(torch.bfloat16)}, src)
    books = tmp_path / "books.json"
    cc.CodebookSet.default().save(books)
    with pytest.raises(TypeError):
        checkpoint.compress_file(src, tmp_path / "a.cckp", 4)  # was: 4 taken as base
    checkpoint.compress_file(src, tmp_path / "a.cckp", codebooks=str(books))
    with pytest.raises(FileExistsError):
        checkpoint.compress_file(src, tmp_path / "a.cckp", force=False)
    with pytest.raises(cc.CodebookError, match="no such file"):
        checkpoint.compress_file(src, tmp_path / "b.cckp", codebooks=tmp_path / "missing.json")
    checkpoint.decompress_file(tmp_path / "a.cckp", tmp_path / "back.pt")
    assert (tmp_path / "back.pt").read_bytes() == src.read_bytes()
