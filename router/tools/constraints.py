"""The output constraint a tool plan puts on the engine (``SamplingParams.structured_outputs``).

    tool_choice        constraint (the engine enforces it, so the output parses)
    -----------        ---------------------------------------------------------
    {"function": f}    json = f's parameters schema: the whole output is the arguments
    "required"         json = [ anyOf over tools of {"name": {"const": NAME},
                       "parameters": <schema>} ], minItems 1, maxItems 1 when
                       parallel_tool_calls is false (vLLM's approach)
    "auto"             none; with a ``strict`` tool a structural tag (xgrammar's
                       legacy format): free text, and after the trigger each call
                       is held to its tool's schema. hermes:
                         begin '<tool_call>\\n{"name": "NAME", "arguments": '
                         end   '}\\n</tool_call>'      trigger '<tool_call>'
                       llama3_json:
                         begin '{"name": "NAME", "parameters": '   end '}'
                         trigger '{"name": '
    "none"             none (tools are still in the prompt, as vLLM renders them)

A request whose output is already constrained (``response_format`` or
``structured_outputs``) cannot also be held to tool calls: refused.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

from cluster.shared.structured import StructuredOutputsParams
from cluster.shared.types import SamplingParams
from router.structured_request import check_json_schema
from router.tools.plan import ToolError, ToolPlan

_TAGS = {
    "hermes": ('<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>", "<tool_call>"),
    "llama3_json": ('{{"name": {name}, "parameters": ', "}", '{"name": '),
}


def required_schema(plan: ToolPlan) -> dict:
    """The JSON schema of ``tool_choice: "required"``: a non-empty array of calls."""
    items = [
        {"type": "object",
         "properties": {"name": {"const": t.name}, "parameters": t.parameters},
         "required": ["name", "parameters"], "additionalProperties": False}
        for t in plan.tools
    ]
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not plan.parallel:
        schema["maxItems"] = 1
    return schema


def structural_tag(plan: ToolPlan) -> dict:
    """The structural tag of ``auto`` with strict tools (every tool's call held to its schema)."""
    begin, end, trigger = _TAGS[plan.parser]
    structures = [{"begin": begin.format(name=json.dumps(t.name)), "schema": t.parameters, "end": end}
                  for t in plan.tools]
    return {"type": "structural_tag", "structures": structures, "triggers": [trigger]}


def tool_constraint(plan: Optional[ToolPlan]) -> Optional[StructuredOutputsParams]:
    """The constraint of ``plan`` (see the table above), or None for free text."""
    if plan is None or plan.choice == "none":
        return None
    if plan.choice == "function":
        spec = plan.tool(plan.function_name or "")
        assert spec is not None, "parse_tool_plan checks the named function exists"
        return StructuredOutputsParams(json=spec.parameters)
    if plan.choice == "required":
        return StructuredOutputsParams(json=required_schema(plan))
    if any(t.strict for t in plan.tools):
        return StructuredOutputsParams(structural_tag=structural_tag(plan))
    return None


def _check_constrained_schemas(plan: ToolPlan) -> None:
    """The parameter schemas the constraint holds calls to must be ones the
    engine enforces in full (a tool only shown in the prompt need not be)."""
    tools = [plan.tool(plan.function_name or "")] if plan.choice == "function" else plan.tools
    for i, spec in enumerate(plan.tools):
        if spec in tools and (plan.choice != "auto" or spec.strict):
            try:
                check_json_schema(spec.parameters, f"tools[{i}].function.parameters")
            except ValueError as exc:
                raise ToolError(str(exc), "tools") from None


def apply_tool_constraint(params: SamplingParams, plan: Optional[ToolPlan]) -> SamplingParams:
    """``params`` with the tool plan's constraint set (unchanged when it has none).

    Raises:
        ToolError: (param ``tool_choice``) ``params`` already has a constraint
            (``response_format`` / ``structured_outputs``), which cannot hold too.
    """
    constraint = tool_constraint(plan)
    if constraint is None:
        return params
    assert plan is not None
    _check_constrained_schemas(plan)
    if params.structured_outputs is not None:
        assert plan is not None
        what = "strict tools (tool_choice auto)" if plan.choice == "auto" else f"tool_choice {plan.choice!r}"
        raise ToolError(f"{what} holds the output to tool calls, and response_format / structured_outputs holds "
                        "it to another format: one output cannot follow both; unset one of them", "tool_choice")
    return dataclasses.replace(params, structured_outputs=constraint)
