"""Long agent sessions for the load benchmark (`--workload long-agent`), shaped like a support
agent's traffic: a shared system prompt (a policy and tool schemas, agent_corpus.py), then per
session a customer's request, the agent's earlier tool calls with their JSON results, and turns
that each append the agent's live reply, the result of the next tool and the customer's next
message, until the last turn's prompt holds 4-6k tokens.

Sizes are counted with the caller's `count_tokens` (the model's tokenizer), and planned with
every live reply at its full allowance (`--max-tokens`): shorter replies leave the last prompt
shorter by what they did not use. A seed and a session's index give the same session on every
machine; sessions share the system prompt and nothing else.

    sessions = make_long_sessions(8, turns=4, count_tokens=lambda s: len(tok.encode(s)))
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from specdec.bench.agent_corpus import PRODUCTS, RESULT_LISTS, customer, list_item, system_prompt, tool_header

FINAL_TOKENS = (4400, 5800)  # the last turn's prompt, with every reply at its allowance
RESULT_TOKENS = (150, 1400)  # one tool result; a result stops one record short of its size
MESSAGE_OVERHEAD = 8  # the chat template's role markers around one message
RESULT_OVERHEAD = 20  # a tool message's wrapper (<tool_response>, the tool's name)

CountTokens = Callable[[str], int]


@dataclass(frozen=True)
class Session:
    """One conversation: the messages before its first request, then the messages each turn
    appends before its request. The runner appends the assistant's live reply after each."""

    opening: list[dict]
    turns: list[list[dict]]


@dataclass(frozen=True)
class Issue:
    opening: str  # the customer's first message; {order}, {request}... filled per session
    follow_ups: tuple[str, ...]
    tools: tuple[str, ...]  # what the agent calls, after lookup_customer, in an order shuffled per session


# Every message names the session's own ids, so that no two sessions share one.
ISSUES = (
    Issue("Hi, my order {order} was supposed to arrive last week and the tracking has not moved. "
          "My email is {email}, billing postal code {postal}. Where is it?",
          ("The carrier page for {order} now says '{status}'. Does that change anything?",
           "If {order} is lost I would rather have a refund than a replacement. What are my options?",
           "Can you also check my other order {order2}? It was placed the same day as {order}.",
           "I am travelling from {date}. Can {order} be held at a pickup point instead?"),
          ("list_orders", "get_order", "track_shipment", "search_knowledge_base", "create_ticket")),
    Issue("I want to return two items from order {order}; one arrived damaged. Email {email}, the card "
          "I paid with ends in {last4}.",
          ("The damaged one is the {product} from {order}. Do I get the shipping fee back too?",
           "How long until the refund for {order} shows on my card ending in {last4}?",
           "The other item in {order} was marked final sale, but nobody told me. Can you make an exception?",
           "Please put the refund for {order} on store credit instead, my card expires in {month}."),
          ("get_order", "search_knowledge_base", "get_invoice", "create_ticket")),
    Issue("I was charged twice for my membership renewal, invoice {invoice}. My account email is {email}.",
          ("The second charge of {amount} on {invoice} is still there today. It is not pending any more.",
           "Which line on {invoice} is the duplicate exactly?",
           "I also see a charge for order {order2} that I never placed, next to {invoice}.",
           "Can a supervisor look at {invoice}? This is the third time it happens."),
          ("get_invoice", "list_orders", "search_knowledge_base", "create_ticket")),
    Issue("Our integration gets 5xx errors from the order API since this morning, e.g. request {request}. "
          "Business account {email}.",
          ("Here is another failing one: {request2}, status 502 at {date}, like {request}.",
           "We rotated our key on {date}, could that be related to the 401s we also see on {request}?",
           "Is there an incident open on your side? {queue} orders are waiting since {request}.",
           "Please open a ticket for your API team about {request} with everything you found."),
          ("search_logs", "get_service_status", "search_logs", "search_knowledge_base", "create_ticket")),
    Issue("Is the {product} in size {size} back in stock anywhere? I ordered it as {order} and it was "
          "cancelled. My email is {email}.",
          ("What about the next delivery to the warehouse in {city}? It is for my cancelled {order}.",
           "Could you reserve one {product} in {size} in place of {order} and ship it when it arrives?",
           "If not, would a different size than {size} ship faster than {order} would have?",
           "Please refund the cancelled order {order} then; I have not seen the money yet."),
          ("check_inventory", "get_order", "list_orders", "check_inventory", "issue_refund")),
)


def make_long_sessions(n: int, turns: int, count_tokens: CountTokens, *, seed: int = 0,
                       reply_tokens: int = 128, window: int = 8192) -> list[Session]:
    """`n` sessions of `turns` turns; raises ValueError when the turns cannot fit the plan."""
    if turns < 1:
        raise ValueError("a long-agent session needs at least one turn")
    if FINAL_TOKENS[1] + reply_tokens > window:
        raise ValueError(f"the plan's last prompt ({FINAL_TOKENS[1]} tokens) plus {reply_tokens} new ones "
                         f"exceed the model's window of {window}")
    system = system_prompt()
    system_tokens = count_tokens(system) + MESSAGE_OVERHEAD
    return [_session(random.Random(f"long-agent:{seed}:{i}"), turns, system, system_tokens, count_tokens,
                     reply_tokens) for i in range(n)]


def _session(rng: random.Random, turns: int, system: str, system_tokens: int, count_tokens: CountTokens,
             reply_tokens: int) -> Session:
    person = customer(rng)
    issue = rng.choice(ISSUES)
    details = _details(rng, person)
    users = [issue.opening.format(**details)]
    users += [_fill(rng, rng.choice(issue.follow_ups), details, person) for _ in range(turns)]
    summary = _summary(rng, details)
    fixed = (system_tokens + sum(count_tokens(u) + MESSAGE_OVERHEAD for u in users)
             + count_tokens(summary) + MESSAGE_OVERHEAD + (turns - 1) * (reply_tokens + MESSAGE_OVERHEAD))
    budget = rng.randint(*FINAL_TOKENS) - fixed
    sizes = plan_results(rng, budget, live=turns - 1)
    tools = ["lookup_customer", *rng.sample(issue.tools, len(issue.tools))]
    steps = [(tools[j % len(tools)], size) for j, size in enumerate(sizes)]
    history_steps = len(sizes) - (turns - 1)

    opening = [{"role": "system", "content": system}, {"role": "user", "content": users[0]}]
    for j, (tool, size) in enumerate(steps[:history_steps]):
        call_id = f"call_{rng.randrange(16**8):08x}"
        call = {"id": call_id, "type": "function",
                "function": {"name": tool, "arguments": json.dumps(_arguments(rng, tool, person, details))}}
        opening.append({"role": "assistant", "content": None, "tool_calls": [call]})
        opening.append({"role": "tool", "tool_call_id": call_id, "name": tool,
                        "content": tool_result(rng, tool, person, size - RESULT_OVERHEAD, count_tokens)})
        if j == history_steps - 1:
            opening.append({"role": "assistant", "content": summary})
    live = [[{"role": "user", "content": users[1]}]]
    for t, (tool, size) in enumerate(steps[history_steps:], start=2):
        result = tool_result(rng, tool, person, size - RESULT_OVERHEAD, count_tokens)
        live.append([{"role": "tool", "name": tool, "content": result},
                     {"role": "user", "content": users[t]}])
    return Session(opening, live)


def plan_results(rng: random.Random, budget: int, live: int) -> list[int]:
    """Token sizes of the tool results that fill `budget`: the earlier calls' first (at least
    one), then one per live turn after the first. Each size lies in RESULT_TOKENS."""
    low, high = RESULT_TOKENS
    parts_fit = budget // low
    if parts_fit < live + 1:
        raise ValueError(f"{live + 1} turns do not fit a {FINAL_TOKENS[1]}-token conversation: "
                         "use fewer turns or a smaller --max-tokens")
    parts = min(parts_fit, max(live + 1, math.ceil(budget / high), round(budget / 700)))
    return split_budget(rng, min(budget, parts * high), parts)


def split_budget(rng: random.Random, budget: int, parts: int) -> list[int]:
    """`parts` sizes in RESULT_TOKENS summing to `budget` (which must lie in parts x the range),
    shared out in proportion to random weights."""
    low, high = RESULT_TOKENS
    weights = [rng.uniform(0.2, 1.0) for _ in range(parts)]
    sizes = [low] * parts
    spare = budget - low * parts
    while spare > 0:
        room = [i for i in range(parts) if sizes[i] < high]
        total = sum(weights[i] for i in room)
        given = 0
        for i in room:
            add = min(high - sizes[i], int(spare * weights[i] / total), spare - given)
            sizes[i] += add
            given += add
        if given == 0:  # what rounding left over: one token at a time to the first with room
            sizes[room[0]] += 1
            given = 1
        spare -= given
    return sizes


def tool_result(rng: random.Random, tool: str, person: dict, size: int, count_tokens: CountTokens) -> str:
    """A tool's JSON result of about `size` tokens: its header, then records while they fit
    (at least one)."""
    header = tool_header(rng, tool, person)
    key, _ = RESULT_LISTS[tool]
    items: list[dict] = []
    used = count_tokens(json.dumps(header)) + 4
    while True:
        item = list_item(rng, tool, person)
        cost = count_tokens(json.dumps(item)) + 1
        if items and used + cost > size:
            break
        items.append(item)
        used += cost
    return json.dumps({**header, key: items})


def _details(rng: random.Random, person: dict) -> dict:
    return {"order": f"ORD-{rng.randrange(100000, 999999)}", "order2": f"ORD-{rng.randrange(100000, 999999)}",
            "email": person["email"], "postal": person["billing"]["postal_code"],
            "last4": person["cards"][0]["last4"], "invoice": f"INV-2024-{rng.randint(1, 9999):04d}",
            "request": f"req_{rng.randrange(16**16):016x}", "product": rng.choice(PRODUCTS),
            "size": rng.choice(("S", "M", "L", "XL", "42", "44"))}


def _fill(rng: random.Random, template: str, details: dict, person: dict) -> str:
    """A follow-up about the session's own ids, with fresh dates and amounts."""
    return template.format(
        **details,
        status=rng.choice(("exception: address unclear", "held at customs", "delivery attempted")),
        date=f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
        month=rng.choice(("March", "June", "October")), amount=f"{rng.uniform(20, 200):.2f}",
        request2=f"req_{rng.randrange(16**16):016x}", city=person["billing"]["city"],
        queue=rng.randint(20, 900))


def _summary(rng: random.Random, details: dict) -> str:
    return rng.choice((
        f"Thanks, you are verified. I have pulled up the records for {details['order']}; here is what I see.",
        f"I checked {details['order']} and your account. Let me go through what the systems show.",
        f"I found your account ({details['email']}). Before I change anything, here is what the tools "
        "returned.",
    ))


def _arguments(rng: random.Random, tool: str, person: dict, details: dict) -> dict:
    """A call's arguments, as the tool's schema (agent_corpus.TOOL_SCHEMAS) lists them."""
    by_tool = {
        "lookup_customer": {"email": person["email"]},
        "get_order": {"order_id": details["order"]},
        "list_orders": {"customer_id": person["customer_id"], "limit": rng.choice((5, 10, 20))},
        "track_shipment": {"tracking_number": f"1Z{rng.randrange(16**12):012X}"},
        "search_logs": {"request_id": details["request"], "level": "WARN"},
        "search_knowledge_base": {"query": rng.choice(("refund to card", "lost parcel", "duplicate charge",
                                                       "api 502 errors", "restock dates")), "top_k": 5},
        "get_invoice": {"invoice_id": details["invoice"]},
        "check_inventory": {"sku": f"SKU-{rng.randrange(10000, 99999)}"},
        "get_service_status": {"component": "all"},
        "create_ticket": {"category": "orders", "priority": "normal",
                          "summary": f"Customer {person['customer_id']} about {details['order']}."},
        "issue_refund": {"order_id": details["order"], "amount": round(rng.uniform(10, 150), 2),
                         "reason": "return"},
    }
    return by_tool.get(tool, {})
