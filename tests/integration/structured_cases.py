"""The prompts, schemas and tools of ``test_structured_cluster.py``: a bounded
Pydantic model, sentences that describe people, two tools with strict
schemas and prompts that call them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

MAX_TOKENS = 160  # Person below is at most ~150 tokens of compact JSON; real answers take ~45


class Person(BaseModel):
    """Every field bounded, so the grammar ends well before MAX_TOKENS."""

    name: Annotated[str, Field(max_length=40)]
    age: Annotated[int, Field(ge=0, le=130)]
    city: Annotated[str, Field(max_length=40)]
    hobbies: Annotated[list[Annotated[str, Field(max_length=30)]], Field(max_length=3)]
    job: Literal["engineer", "teacher", "doctor", "artist", "other"]


SENTENCES = [
    "Maria Lopez is a 34 year old teacher from Madrid who loves painting and hiking.",
    "Tom, 52, works as a doctor in Chicago; he plays golf.",
    "Akira is an engineer aged 29 living in Osaka. Hobbies: chess, cycling.",
    "Lena (41) paints for a living in Berlin and enjoys swimming.",
    "Omar Haddad, a 63-year-old doctor in Cairo, collects stamps.",
    "Sophie is 25, teaches math in Lyon and likes running and jazz.",
    "In Toronto lives Raj, 38, a software engineer who bakes bread.",
    "Ingrid, 47, is an artist from Oslo who skis every winter.",
    "Carlos (30) is a teacher in Lima. He surfs and reads novels.",
    "Mei Lin, 22, studies to be a doctor in Taipei and plays violin.",
    "Hans is an 70-year-old retired engineer in Munich who gardens.",
    "Aisha, 19, an artist in Nairobi, loves dancing and photography.",
    "Pierre Dubois, 55, teaches history in Paris and fishes on weekends.",
    "Yuki, a 33 year old doctor from Kyoto, practices archery.",
    "Liam, 27, is a sculptor in Dublin who climbs mountains.",
    "Fatima is 44 and works as an engineer in Casablanca; she knits.",
    "Noah, 36, a nurse from Sydney, enjoys sailing and cooking.",
    "Elena (58) teaches piano in Rome and loves opera.",
    "Kwame, 31, is a civil engineer in Accra who plays football.",
    "Olga, 66, a retired doctor in Kyiv, writes poetry and walks her dog.",
]

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False,
}
CURRENCY = {
    "type": "object",
    "properties": {"amount": {"type": "integer", "minimum": 0, "maximum": 1000000},
                   "from_currency": {"type": "string", "enum": ["USD", "EUR", "JPY", "GBP"]},
                   "to_currency": {"type": "string", "enum": ["USD", "EUR", "JPY", "GBP"]}},
    "required": ["amount", "from_currency", "to_currency"], "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "convert_currency", "description": "Convert money",
                                      "parameters": CURRENCY}},
]
SCHEMAS = {"get_weather": WEATHER, "convert_currency": CURRENCY}
TOOL_PROMPTS = [
    "What is the weather in Paris right now, in celsius?",
    "How much is 250 USD in EUR?",
    "Is it warm in Miami today? Use fahrenheit.",
    "Convert 1000 JPY to GBP please.",
    "Tell me the temperature in Tokyo.",
    "I have 40 euros, how many dollars is that?",
]
