"""``bench.profile_load.places``: py-spy's raw stacks split by whose code a busy sample is in."""

from bench.profile_load import places

LOOP = "<module> (vllm:6);main (vllm/entrypoints/cli/main.py:95);Runner.run (asyncio/runners.py:118)"


def stack(*frames: str, count: int = 1) -> str:
    return ";".join([LOOP, *frames]) + f" {count}"


def test_each_sample_goes_to_the_first_place_in_its_stack_below_the_loop():
    raw = "\n".join(
        [
            stack(
                "run_operation (vllm_nnrp_plugin/core/adapter.py:199)",
                "EngineStream.items (vllm_nnrp_plugin/x.py:1)",
                "DelegatingParser.parse_delta (vllm/parser/abstract_parser.py:886)",
                "MutexValue.inc (prometheus_client/values.py:28)",
                count=3,
            ),  # the parser's own metrics: the parser
            stack(
                "FlushRound._run (vllm_nnrp_plugin/nnrp_binding/connection.py:125)",
                "NNRPConnection._write (vllm_nnrp_plugin/nnrp_binding/connection.py:508)",
                "StreamConnection.send (vllm_nnrp_plugin/nnrp_binding/stream.py:66)",
                count=4,
            ),
            stack(
                "run_operation (vllm_nnrp_plugin/core/adapter.py:199)",
                "ChatStreamMapper.feed (vllm_nnrp_plugin/p.py:1)",
                count=2,
            ),
            stack("output_handler (vllm/v1/engine/async_llm.py:675)", count=1),
            stack("select (selectors.py:468)", count=50),  # an idle loop: not busy
        ]
    )
    assert places(raw) == {
        "socket writes (the kernel's loopback TCP or UDP)": 40.0,
        "vLLM's tool-call/reasoning parser": 30.0,
        "the plugin": 20.0,
        "vLLM's engine client (output processing, detokenising, stats)": 10.0,
    }


def test_vllms_own_entry_frames_above_the_loop_count_for_nobody():
    raw = stack("Runner.run (asyncio/runners.py:118)", count=1)  # the loop's own work: its root frames only
    assert places(raw) == {"event loop and other": 100.0}
