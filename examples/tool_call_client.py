"""An agent's turn through `specdec serve` with the official OpenAI client: the reply must
call one of the tools of examples/tools.json, with arguments that follow its schema.

    specdec serve --config examples/agents.yaml      # in another shell
    python examples/tool_call_client.py [BASE_URL]   # default http://127.0.0.1:8000/v1
"""

import json
import sys
from pathlib import Path

from openai import OpenAI

base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
client = OpenAI(base_url=base_url, api_key="unused")  # any key, unless the server asks for one
tools = json.loads((Path(__file__).parent / "tools.json").read_text())

reply = client.chat.completions.create(
    model=client.models.list().data[0].id,
    messages=[{"role": "user", "content": "What will the weather be in Denver on 2025-05-17?"}],
    tools=tools,
    tool_choice="required",  # a grammar makes the reply a well-formed call
    parallel_tool_calls=False,
    temperature=0,
    max_tokens=96,
    extra_body={"return_spec_decode": True},  # specdec's own field: drafted, accepted, forced, tau
)
call = reply.choices[0].message.tool_calls[0]
print(call.function.name, json.loads(call.function.arguments))
print(reply.spec_decode)
