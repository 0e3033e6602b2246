"""The committed stubs in router/pb/ match proto/ (regenerated and diffed) and the contract's shape."""

from __future__ import annotations

import difflib
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

from cluster.shared.types import SamplingParams
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
PB_DIR = ROOT / "router" / "pb"
GENERATED = ("generation_pb2.py", "generation_pb2_grpc.py", "generation_pb2.pyi")


def test_committed_stubs_match_the_proto(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(GENERATED)
    for name in GENERATED:
        fresh = (tmp_path / name).read_text().splitlines(keepends=True)
        committed = (PB_DIR / name).read_text().splitlines(keepends=True)
        diff = "".join(difflib.unified_diff(committed, fresh, f"router/pb/{name}", "regenerated"))
        assert not diff, f"router/pb/{name} is stale: run `python scripts/gen_proto.py`\n{diff}"


def test_stubs_are_package_relative_and_keep_the_canonical_proto_name():
    assert pb.DESCRIPTOR.name == "prefixserve/v1/generation.proto"
    assert pb.DESCRIPTOR.package == "prefixserve.v1"
    assert pb.GenerateRequest.__module__ == "router.pb.generation_pb2"  # picklable by reference
    assert pb_grpc.prefixserve_dot_v1_dot_generation__pb2 is pb
    assert not (ROOT / "proto" / "__init__.py").exists(), "proto/ must not shadow proto-plus's `proto` module"


def test_service_methods():
    service = pb.DESCRIPTOR.services_by_name["Generation"]
    assert service.full_name == "prefixserve.v1.Generation"
    generate = service.methods_by_name["Generate"]
    assert generate.server_streaming and not generate.client_streaming
    assert generate.input_type.name == "GenerateRequest" and generate.output_type.name == "GenerateResponse"
    listing = service.methods_by_name["ListReplicas"]
    assert not listing.server_streaming and listing.output_type.name == "ListReplicasResponse"
    assert hasattr(pb_grpc, "GenerationStub") and hasattr(pb_grpc, "add_GenerationServicer_to_server")


def test_sampling_params_mirror_the_python_fields():
    desc = pb.SamplingParams.DESCRIPTOR
    from router.convert import _OFFLINE_ONLY

    assert {f.name for f in fields(SamplingParams)} - set(_OFFLINE_ONLY) == set(desc.fields_by_name)
    # Fields whose zero is a meaningful value must track presence.
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs",
                 "repetition_penalty", "presence_penalty", "frequency_penalty"):
        assert desc.fields_by_name[name].has_presence, name


def test_generate_request_input_is_a_oneof():
    oneof = pb.GenerateRequest.DESCRIPTOR.oneofs_by_name["input"]
    assert [f.name for f in oneof.fields] == ["prompt", "prompt_token_ids", "messages"]
    msg = pb.GenerateRequest(prompt="hi")
    msg.prompt_token_ids.ids.extend([1, 2])
    assert msg.WhichOneof("input") == "prompt_token_ids" and msg.prompt == ""


def test_tool_fields_round_trip_with_their_numbers():
    numbers = {name: f.number for name, f in pb.GenerateRequest.DESCRIPTOR.fields_by_name.items()}
    assert {k: numbers[k] for k in ("tools", "tool_choice", "tool_choice_function", "parallel_tool_calls")} == {
        "tools": 8, "tool_choice": 9, "tool_choice_function": 10, "parallel_tool_calls": 11}
    assert pb.GenerateRequest.DESCRIPTOR.fields_by_name["parallel_tool_calls"].has_presence
    assert [(f.name, f.number) for f in pb.ChatMessage.DESCRIPTOR.fields] == [
        ("role", 1), ("content", 2), ("tool_calls", 3), ("tool_call_id", 4), ("name", 5)]
    assert [(f.name, f.number) for f in pb.Tool.DESCRIPTOR.fields] == [
        ("name", 1), ("description", 2), ("parameters_json", 3), ("strict", 4)]
    assert [(f.name, f.number) for f in pb.ToolCall.DESCRIPTOR.fields] == [("id", 1), ("name", 2), ("arguments", 3)]
    assert pb.GenerateResponse.DESCRIPTOR.fields_by_name["tool_calls"].number == 6

    msg = pb.GenerateRequest(
        tools=[pb.Tool(name="get_weather", description="Weather now", strict=True,
                       parameters_json='{"type": "object", "properties": {"city": {"type": "string"}}}')],
        tool_choice="function", tool_choice_function="get_weather", parallel_tool_calls=False)
    msg.messages.items.add(role="assistant", tool_calls=[pb.ToolCall(id="call_1", name="get_weather",
                                                                     arguments='{"city": "Paris"}')])
    msg.messages.items.add(role="tool", content="18 C", tool_call_id="call_1", name="get_weather")
    back = pb.GenerateRequest.FromString(msg.SerializeToString())
    assert back == msg
    assert back.HasField("parallel_tool_calls") and back.parallel_tool_calls is False
    assert not pb.GenerateRequest().HasField("parallel_tool_calls")
    assert back.tools[0].parameters_json == '{"type": "object", "properties": {"city": {"type": "string"}}}'
    assert [(m.role, [(c.id, c.name, c.arguments) for c in m.tool_calls], m.tool_call_id, m.name)
            for m in back.messages.items] == [
        ("assistant", [("call_1", "get_weather", '{"city": "Paris"}')], "", ""),
        ("tool", [], "call_1", "get_weather")]
    response = pb.GenerateResponse(finish_reason="tool_calls", tool_calls=[pb.ToolCall(id="call_2", name="f",
                                                                                      arguments="{}")])
    assert pb.GenerateResponse.FromString(response.SerializeToString()).tool_calls[0] == response.tool_calls[0]
