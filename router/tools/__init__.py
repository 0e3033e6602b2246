"""OpenAI tool calling (``tools``, ``tool_choice``, ``parallel_tool_calls``) on the router.

A request's path through this package::

    body ──parse_tool_plan──▶ ToolPlan (validated tools, choice, parallel, parser)
         ──plan.prompt_tools()──▶ RouterTokenizer.render_chat(messages, tools=...)
              a template that takes ``tools`` gets them; any other gets the
              built-in Hermes block (``cluster/shared/chat_template.py``)
         ──apply_tool_constraint──▶ SamplingParams.structured_outputs
              (named: the arguments' schema; required: an array of calls;
              auto with strict tools: a structural tag; see ``constraints``)
    output ──make_parser(plan).feed(piece) ... .finish()──▶ content + tool-call deltas
           (a whole answer: parse_tool_output; finish_reason: tool_finish_reason)

Output formats (``tool_call_parser``; ``resolve_parser("auto", template)``
picks from the chat template, a router flag may force one):

    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
                 (Qwen2.5/3, Hermes, and every template without tools, which
                 gets the built-in block asking for exactly this)
    llama3_json  {"name": "f", "parameters": {...}}; {...}   (Llama 3.1+ templates)

Calls come back as OpenAI's ``message.tool_calls`` (``id`` "call_" + 24
alphanumerics, ``type`` "function", ``function.arguments`` JSON text).
``tool_choice: "none"`` keeps the tools in the prompt (vLLM's behaviour;
OpenAI does not say) and returns the text as content, unparsed.

The gRPC server supports tools the same way by calling, in order:
``parse_tool_plan``, ``render_chat(..., tools=plan.prompt_tools())``,
``apply_tool_constraint`` and, on the output, ``make_parser`` (streamed) or
``parse_tool_output`` (whole), catching :class:`ToolError` as INVALID_ARGUMENT.
"""

from router.tools.calls import ParserDelta, ToolCall, ToolCallDelta, ToolCallParser, ToolOutput, assemble, new_call_id
from router.tools.constraints import apply_tool_constraint, required_schema, structural_tag, tool_constraint
from router.tools.parsers import make_parser, parse_tool_output, tool_finish_reason
from router.tools.plan import (ToolError, ToolPlan, ToolSpec, check_tool_calls, message_tool_fields, parse_tool_plan,
                               resolve_parser)

__all__ = [
    "ParserDelta", "ToolCall", "ToolCallDelta", "ToolCallParser", "ToolError", "ToolOutput", "ToolPlan", "ToolSpec",
    "apply_tool_constraint", "assemble", "check_tool_calls", "make_parser", "message_tool_fields", "new_call_id",
    "parse_tool_output", "parse_tool_plan", "required_schema", "resolve_parser", "structural_tag", "tool_constraint",
    "tool_finish_reason",
]
