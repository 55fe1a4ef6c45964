"""Shared fixtures, the hypothesis profile, and the test tiers.

Hypothesis runs with no example database (nothing is written outside tests/) and no
deadline (the first call of a numba kernel may compile).

Every test gets its tier marker here, from :data:`TIERS` (registered in setup.cfg):

* ``unit``: in one process, fast;
* ``dist``: spawns torch.distributed (gloo) ranks, through tests/dist_utils.py;
* ``cli``: runs the ``comm-codec`` command line in subprocesses;
* ``slow``: what the quick tier, ``python -m pytest tests -m "not slow"`` (under two
  minutes on a 2-core machine with warm numba caches), leaves out; :data:`SLOW` lists it.

A test module missing from :data:`TIERS` fails the collection, so that a new file gets a tier.
"""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

import comm_codec as cc

settings.register_profile(
    "comm_codec",
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("comm_codec")

TESTS = Path(__file__).resolve().parent

# test_deepspeed.py's tests of one module-scoped run of fresh gloo ranks (DeepSpeed training)
_DEEPSPEED_RUN = (
    "test_losses_equal_without_plugin", "test_stats_show_every_reduction_coded_and_fewer_bytes",
    "test_all_reduced_gradients_bit_identical_across_ranks", "test_owner_reduce_path_sends_no_all_reduce",
    "test_online_warmup_reduces_plainly_then_codes_with_identical_books",
    "test_cast_bf16_is_lossy_but_close_and_sends_about_half", "test_deepspeed_monitor_gets_comm_codec_events",
    "test_failures_that_need_a_process_group", "test_coding_leaves_torch_thread_count_alone",
)

# test module -> its tier markers, or (markers, {test name pattern: markers}) where some
# of its tests are in another tier. Patterns are fnmatch patterns over the test's name
# (without parameters); the first that matches wins.
TIERS = {
    "test_assemble.py": "unit",
    "test_autoswitch.py": "unit",
    "test_bench.py": "unit",  # bench.run in-process
    "test_huff0.py": "unit",
    "test_checkpoint.py": ("unit", {"test_cli_*": "cli"}),
    "test_checkpoint_imports.py": "cli",  # fresh interpreters run the API calls and the commands
    "test_checkpoint_truncated.py": "cli",
    "test_checkpoint_restore.py": "unit",
    "test_cli.py": "cli",
    "test_cli_conventions.py": "unit",  # the command line in-process (cli.main), real pipes and a pty
    "test_codec.py": "unit",
    "test_encode_kernels.py": "unit",
    "test_checkpoint_plan_kernels.py": "unit",
    "test_collectives.py": ("dist", {"test_engine_precompiles_the_coded_dtype_before_a_coded_call": "unit",
                                     "test_a_first_coded_call_that_waits_for_kernels_says_so": "unit"}),
    "test_cuda.py": "unit",  # the simulator run is pytest in a child process, not the CLI
    "test_dcp.py": ("unit", {"test_fsdp2_*": "dist"}),
    "test_ddp.py": ("dist", {"test_hook_annotations_are_the_types_ddp_checks": "unit",
                             "test_huffman_state_rejects_bad_arguments": "unit",
                             "test_huffman_state_codebooks_from_path": "unit"}),
    "test_decode_lanes.py": "unit",
    "test_deepspeed.py": ("unit", dict.fromkeys(_DEEPSPEED_RUN, "dist")),
    "test_directories.py": "unit",  # the command line in-process (cli.main)
    "test_frame.py": "unit",
    "test_fsdp.py": ("dist", {"test_state_validates_options": "unit",
                              "test_demo_command_rejects_bad_options": "unit",
                              "test_comm_codec_demo_fsdp_runs_and_prints_the_bytes_saved": "cli dist",
                              "test_codec_threads_default_to_the_ranks_share_of_the_cores": "unit"}),
    "test_errors.py": "unit",
    "test_fuzz.py": "unit",
    "test_golden.py": "unit",
    "test_groups.py": ("unit", {"test_distributed_build_equals_one_process_over_all_ranks_data": "dist"}),
    "test_huffman.py": "unit",
    "test_integrations.py": "dist",
    "test_layers.py": "unit",
    "test_netns.py": "unit",  # real network namespaces where the process may make them
    "test_lossy.py": ("unit", {"test_metadata_round_trip_and_inspect": "cli",
                               "test_cli_round_trip_and_errors": "cli"}),
    "test_plane.py": "unit",
    "test_precompile.py": ("cli", {"test_no_kernel_is_compiled_with_numba_parallel": "unit"}),  # fresh interpreters, empty caches
    "test_profiler.py": "unit",
    "test_streams.py": "unit",
    "test_zero3.py": "dist",
    "test_untrusted_bounds.py": ("unit", {"test_every_command_works_*": "cli", "test_a_bad_numba_*": "cli"}),
    "test_untrusted_names.py": "cli",
    "test_schema.py": "unit",
    "test_untrusted_lossy.py": ("cli", {"test_rounding_meets_*": "unit"}),
    "test_untrusted.py": ("unit", {"test_crafted_inputs_exit_cleanly_in_bounded_memory": "cli",
                                   "test_termination_signals_remove_the_temp_file": "cli",
                                   "test_a_later_run_removes_stale_temp_files_of_dead_runs": "cli"}),
}

# test module -> what the quick tier leaves out: fnmatch patterns over test names, with
# parameters ("test_x[2-bf16]", "test_x[*-bf16]") or without ("test_x": every case);
# "*" is every test, and "!pattern" takes tests back into the quick tier. As in .gitignore, the last pattern that matches a
# test decides. Chosen from `pytest --durations=0`: the quick tier keeps a few tests of
# every module where that is cheap, and shares one 2-rank gloo group among its dist tests
# (3 and 4 ranks, fresh groups and module-wide training runs are slow).
SLOW: dict[str, tuple[str, ...]] = {
    "test_bench.py": ("test_bench_model_file_rows_and_zipnn_columns",),
    "test_checkpoint.py": ("test_safetensors_round_trip_all_dtypes", "test_delta_chain_of_three",
                           "test_same_output_for_any_number_of_threads", "test_cli_round_trip_and_errors"),
    "test_checkpoint_imports.py": ("*", "!test_checkpoint_calls_do_not_import_torch[safetensors]"),
    "test_checkpoint_truncated.py": ("*[decompress]",),
    "test_cli.py": ("*", "!test_version_and_help", "!test_unknown_option_is_a_usage_error", "!test_inspect_frame"),
    "test_codec.py": ("test_frames_from_numpy_bytes_and_buffers_decode",
                      "test_precompile_loads_kernels_and_reports_per_dtype"),
    "test_collectives.py": ("*world3*", "test_all_reduce_bit_exact_rank_order[*]",
                            "!test_all_reduce_bit_exact_rank_order[sum-bf16-world2]",
                            "!test_all_reduce_bit_exact_rank_order[average-fp32-world2]",
                            "test_reduce_scatter_bit_exact_rank_order[*]",
                            "!test_reduce_scatter_bit_exact_rank_order[average-bf16-world2]",
                            "test_a_peer_announcing_an_impossible_size_fails_every_honest_rank_in_time"),
    "test_cuda.py": ("test_cuda_kernels_in_simulator",),
    "test_dcp.py": ("test_fsdp2_checkpoint_of_two_ranks_loads_on_four",),
    "test_ddp.py": ("*world3*", "test_ddp_gradients_bit_exact_rank_order_average[*]",
                    "!test_ddp_gradients_bit_exact_rank_order_average[warmup2-bf16-world2]",
                    "test_ddp_robust_configurations_stay_bit_exact[*]",
                    "!test_ddp_robust_configurations_stay_bit_exact[static_graph_unused_branch-world2]",
                    "test_ddp_exact_with_bf16_model_and_tiny_buckets", "test_training_matches_plain_ddp_losses",
                    "test_cast_bf16_training_close_to_plain", "test_stats_after_training",
                    "test_ranks_configured_differently_raise_on_every_rank_at_the_first_step",
                    "test_rank_dying_mid_decision_makes_the_others_raise",
                    "test_stalled_peer_raises_within_the_users_timeout", "test_a_pickle_from_a_peer_is_never_unpickled",
                    "test_stats_count_every_call_plain_and_coded[auto-2]"),
    "test_deepspeed.py": _DEEPSPEED_RUN,
    "test_fsdp.py": ("test_bit_identical_to_rank_order_reference", "test_mode_never_is_plain_fsdp2",
                     "test_async_all_gather_returns_work", "test_corrupt_frame_fails_on_every_rank",
                     "test_frozen_parameters_of_another_dtype_travel_plainly", "*world4*",
                     "test_comm_codec_demo_fsdp_runs_and_prints_the_bytes_saved",
                     "test_a_stalled_rank_fails_the_other_within_the_users_timeout"),
    "test_integrations.py": ("*",),
    "test_lossy.py": ("test_cli_round_trip_and_errors",),
    "test_precompile.py": ("test_after_precompile_no_public_path_compiles", "test_a_first_compile_is_said_*"),
    "test_untrusted_names.py": "cli",
    "test_untrusted_lossy.py": ("test_a_gigabyte_claim_is_streamed_in_bounded_memory",),
    "test_zero3.py": ("test_zero3_world4_bit_identical_to_rank_order_reference",
                      "test_a_stalled_rank_fails_the_other_within_the_users_timeout",
                      "test_zero3_warmup_builds_books_for_weights_and_gradients", "test_offload_at_stage_*"),
    "test_untrusted.py": ("test_crafted_inputs_exit_cleanly_in_bounded_memory",
                          "test_termination_signals_remove_the_temp_file[1]"),
}


def matches(name: str, pattern: str) -> bool:
    """Whether a test name ("test_x" or "test_x[params]") matches a SLOW pattern.

    A pattern's brackets hold a pattern over the parameters (not an fnmatch character
    class): "test_x[*-bf16]" is every bf16 case of test_x; "test_x" is all of them.
    """
    base, _, params = name.partition("[")
    pbase, bracket, pparams = pattern.partition("[")
    if not bracket:
        return fnmatch.fnmatchcase(base, pattern) or fnmatch.fnmatchcase(name, pattern)
    return fnmatch.fnmatchcase(base, pbase) and fnmatch.fnmatchcase(params.removesuffix("]"),
                                                                     pparams.removesuffix("]"))


def is_slow(module: str, name: str) -> bool:
    """Whether SLOW leaves a test out of the quick tier (the last matching pattern decides)."""
    slow = False
    for pattern in SLOW.get(module, ()):
        if matches(name, pattern.lstrip("!")):
            slow = not pattern.startswith("!")
    return slow


def tier_markers(module: str, name: str) -> list[str]:
    """The markers of one test (``name`` with its parameters): its tier(s) from TIERS, and
    ``slow`` if SLOW leaves it out of the quick tier.

    Raises:
        KeyError: the module is not in TIERS.
    """
    spec = TIERS[module]
    markers, overrides = (spec, {}) if isinstance(spec, str) else spec
    for pattern, these in overrides.items():
        if fnmatch.fnmatchcase(name.partition("[")[0], pattern):
            markers = these
            break
    return markers.split() + (["slow"] if is_slow(module, name) else [])


def pytest_collection_modifyitems(config, items):
    unknown = set()
    for item in items:
        path = Path(str(item.fspath)).resolve()
        try:
            module = path.relative_to(TESTS).as_posix()
        except ValueError:
            continue  # not one of ours (a path given on the command line outside tests/)
        if module not in TIERS:
            unknown.add(module)
            continue
        for marker in tier_markers(module, item.name):
            item.add_marker(marker)
    if unknown:
        raise pytest.UsageError(
            f"tests/conftest.py gives no tier to {', '.join(sorted(unknown))}: add each to TIERS "
            f"(unit, dist or cli) and, if the quick tier cannot afford its tests, to SLOW")


class _SimulatorRun:
    """Starts test_cuda.py's simulator child early and checks it last
    (:func:`test_cuda.start_simulator_run`)."""

    @pytest.hookimpl(trylast=True)  # after -k / -m deselection: these items run
    def pytest_collection_modifyitems(self, config, items):
        sim = [item for item in items if item.name == "test_cuda_kernels_in_simulator"]
        if sim and not config.option.collectonly:
            items.remove(sim[0])
            items.append(sim[0])
            sim[0].module.start_simulator_run()
            self.module = sim[0].module

    def pytest_sessionfinish(self):
        if getattr(self, "module", None) is not None:
            self.module.stop_simulator_run()


def pytest_configure(config):
    config.pluginmanager.register(_SimulatorRun(), "comm_codec_simulator_run")


def _test_names(path: Path) -> set[str]:
    """The names of the test functions a module defines (module level and in classes)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            names.add(node.name)
    return names


def stale_entries() -> list[str]:
    """TIERS and SLOW entries that name no test module, or patterns that match none of its tests."""
    stale = []
    for module in sorted(set(TIERS) | set(SLOW)):
        path = TESTS / module
        if not path.is_file():
            stale.append(f"{module} (no such test module)")
            continue
        names = _test_names(path)
        spec = TIERS.get(module)
        patterns = list(spec[1]) if isinstance(spec, tuple) else []
        # parameters are known only once collected: check the name before them
        patterns += [p.lstrip("!").split("[")[0] for p in SLOW.get(module, ()) if p.lstrip("!").startswith("test")]
        stale += [f"{module}::{p} (matches no test)" for p in patterns
                  if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    return stale


def pytest_sessionstart(session):
    """Refuse TIERS or SLOW entries that no longer match a test (a renamed file or test)."""
    stale = stale_entries()
    if stale:
        raise pytest.UsageError("tests/conftest.py: stale TIERS or SLOW entries: " + "; ".join(stale))


@pytest.fixture(scope="session")
def default_books() -> cc.CodebookSet:
    return cc.CodebookSet.default()


@pytest.fixture(scope="session")
def codec(default_books) -> cc.Codec:
    """A codec with the shipped books and default settings."""
    return cc.Codec(default_books)


@pytest.fixture(scope="session")
def small_codec(default_books) -> cc.Codec:
    """A codec with 64-element chunks, so that small inputs span many chunks."""
    return cc.Codec(default_books, chunk_elems=64)
