"""The raw material of the long agent sessions (long_sessions.py): a support agent's policy,
its tool schemas, and seeded makers of the records its tools return.

Everything here is written for this benchmark and drawn from a `random.Random`, so a seed
gives the same text on every machine. The policy and the schemas form the system prompt that
all sessions share; the records carry random ids, names and amounts, so two sessions share
nothing else.
"""

from __future__ import annotations

import json
import random

COMPANY = "Northwind Outfitters"

POLICY_SECTIONS: dict[str, tuple[str, ...]] = {
    "Role": (
        f"You are the tier-1 support agent of {COMPANY}, an online retailer of outdoor gear that "
        "ships to customers in North America and Europe.",
        "You resolve questions about orders, shipments, returns, refunds, billing, accounts and the "
        "developer API by calling the tools listed below and reading their results.",
        "You answer in plain, short sentences. You never invent an order, an amount, a date or a "
        "policy; when a tool result does not say it, you say that you do not know yet.",
    ),
    "Identity verification": (
        "Before you reveal or change anything on an account, verify the customer: they must give "
        "the email on the account and either the postal code of the billing address or the last "
        "four digits of a stored card.",
        "Call lookup_customer with the email first; compare the answers with the record, never "
        "read the stored values out to the customer.",
        "After two failed attempts, stop, tell the customer that the account is protected, and "
        "create a ticket of category security with priority high.",
        "Never verify a customer by order number alone: order numbers are printed on packing slips "
        "that other people handle.",
    ),
    "Orders and shipments": (
        "Use get_order for one order and list_orders for a customer's history; list at most the "
        "last ten orders unless the customer asks for an older one by number.",
        "An order in status processing can still be changed or cancelled with update_order; once "
        "it is shipped it can only be returned.",
        "Use track_shipment for the carrier's events. A parcel with no scan for five business days "
        "is considered lost: offer a replacement or a refund, the customer's choice.",
        "Delivery estimates come from the carrier; quote them as estimates and name the carrier.",
        "Address changes after shipment go through the carrier's redirect service; tell the "
        "customer it may add two business days and is not always possible.",
    ),
    "Returns and refunds": (
        "Items may be returned within 30 days of delivery, unworn and with their tags; gold and "
        "platinum members get 60 days. Final-sale items cannot be returned.",
        "Refunds go back to the original payment method. Store credit is offered only when the "
        "customer asks for it or the payment method has expired.",
        "You may issue refunds yourself with issue_refund up to 150.00 in the order's currency per "
        "order; larger amounts, or a second refund on the same order, need escalate_to_human.",
        "Shipping fees are refunded only when the item arrived damaged, was wrong, or was late by "
        "more than five business days against the carrier's first estimate.",
        "Always state the amount, the currency and the expected time to appear on the statement: "
        "three to seven business days for cards, one day for store credit.",
    ),
    "Billing": (
        "Use get_invoice for charges and subscription renewals. Explain each line before you "
        "suggest that a charge is wrong.",
        "A duplicate charge is a pending authorization in most cases; it disappears within five "
        "business days. Only a settled duplicate may be refunded.",
        "Never take card numbers in the chat. Payment methods are changed by the customer in the "
        "account settings; send them the help article from search_knowledge_base.",
    ),
    "Developer API": (
        "Business customers use the order API. For errors, ask for the request id and call "
        "search_logs with it; quote the error code and the message, never the stack trace.",
        "Errors 401 and 403 are credentials: point the customer to key rotation in the developer "
        "console. Error 429 is the rate limit of 600 requests per minute per key.",
        "Errors 500 to 599 that repeat for more than ten minutes are incidents: check "
        "get_service_status and, when no incident is open, create a ticket of category api.",
    ),
    "Escalation and tickets": (
        "Create a ticket with create_ticket for anything you cannot finish in this conversation, "
        "and give the customer its id.",
        "Escalate to a human with escalate_to_human when the customer asks for a person twice, "
        "mentions legal action or a safety problem with a product, or when a refund exceeds your "
        "limit.",
        "Write ticket summaries for a colleague who has not read the chat: the customer id, the "
        "order ids, what was checked, what was promised and what is left to do.",
    ),
    "Privacy": (
        "Share account data only with the verified account holder. Do not confirm whether an "
        "email address has an account to anyone who is not verified.",
        "Do not repeat full addresses, phone numbers or payment details back to the customer; "
        "refer to them by city or by the last four digits.",
        "Requests to delete an account or export its data go to create_ticket with category "
        "privacy; they are completed within 30 days.",
    ),
    "Tool use": (
        "Call one tool at a time with exactly the arguments its schema lists, and wait for its "
        "result before you answer.",
        "To call a tool, write one <tool_call> block holding a JSON object {\"name\": ..., "
        "\"arguments\": {...}}; to answer the customer, write text only.",
        "Read the whole tool result before you answer: the status of the last event, not the "
        "first, is the current one.",
        "If a tool returns an error, retry once with corrected arguments, then tell the customer "
        "what failed and create a ticket.",
    ),
}


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


def _s(description: str, **extra) -> dict:
    return {"type": "string", "description": description, **extra}


TOOL_SCHEMAS: tuple[dict, ...] = (
    _tool("lookup_customer", "Find a customer account by email.", {"email": _s("the account email")},
          ["email"]),
    _tool("get_order", "One order with its items, payments and status.", {"order_id": _s("e.g. ORD-100234")},
          ["order_id"]),
    _tool("list_orders", "A customer's orders, newest first.",
          {"customer_id": _s("e.g. C-48213"), "limit": {"type": "integer", "minimum": 1, "maximum": 50}},
          ["customer_id"]),
    _tool("track_shipment", "The carrier's events for a tracking number.",
          {"tracking_number": _s("the carrier's tracking number")}, ["tracking_number"]),
    _tool("update_order", "Change or cancel an order that has not shipped.",
          {"order_id": _s("the order"),
           "action": _s("what to do", enum=["cancel", "change_address", "change_item"]),
           "details": {"type": "object", "description": "the new address or item"}}, ["order_id", "action"]),
    _tool("issue_refund", "Refund an order, in full or in part, within the agent's limit.",
          {"order_id": _s("the order"), "amount": {"type": "number", "minimum": 0},
           "reason": _s("why", enum=["damaged", "wrong_item", "late", "return", "goodwill"])},
          ["order_id", "amount", "reason"]),
    _tool("get_invoice", "A billing invoice with its lines.", {"invoice_id": _s("e.g. INV-2024-0412")},
          ["invoice_id"]),
    _tool("search_knowledge_base", "Help articles matching a query.",
          {"query": _s("what to look for"), "top_k": {"type": "integer", "minimum": 1, "maximum": 20}},
          ["query"]),
    _tool("search_logs", "API log entries of a business customer.",
          {"request_id": _s("the failing request's id"), "since": _s("ISO time", format="date-time"),
           "level": _s("minimum level", enum=["DEBUG", "INFO", "WARN", "ERROR"])}, ["request_id"]),
    _tool("check_inventory", "Stock of a product in each warehouse.", {"sku": _s("e.g. SKU-20391")}, ["sku"]),
    _tool("get_service_status", "Open incidents of the order API and the storefront.",
          {"component": _s("which part", enum=["api", "storefront", "payments", "all"])}, []),
    _tool("create_ticket", "Open a ticket for the back office.",
          {"category": _s("queue", enum=["orders", "billing", "api", "security", "privacy"]),
           "priority": _s("urgency", enum=["low", "normal", "high"]), "summary": _s("for a colleague")},
          ["category", "summary"]),
    _tool("escalate_to_human", "Hand the conversation to a human agent.",
          {"reason": _s("why a person is needed"), "customer_id": _s("the customer")}, ["reason"]),
)


def system_prompt() -> str:
    """The policy and the tool schemas: the one prefix every session shares."""
    parts = [f"# Support policy of {COMPANY}"]
    for title, rules in POLICY_SECTIONS.items():
        parts.append(f"\n## {title}\n" + "\n".join(f"- {rule}" for rule in rules))
    parts.append("\n## Tools\nYou can call these tools (JSON schemas):")
    parts.extend(json.dumps(tool["function"], separators=(", ", ": ")) for tool in TOOL_SCHEMAS)
    return "\n".join(parts)


# ---- seeded records ---------------------------------------------------------------------------

FIRST = ("Ada", "Bruno", "Chiara", "Dmitri", "Elif", "Farah", "Goran", "Hana", "Ines", "Jonas", "Kemal",
         "Lena", "Mateo", "Nadia", "Oskar", "Priya", "Quinn", "Rosa", "Soren", "Tomas", "Uma", "Viktor")
LAST = ("Adler", "Baptiste", "Costa", "Dvorak", "Eriksen", "Fischer", "Garcia", "Holm", "Ivanova",
        "Jensen", "Kowalski", "Lindqvist", "Moreau", "Novak", "Okafor", "Petrov", "Rossi", "Schmidt")
CITIES = (("Portland", "OR", "US"), ("Denver", "CO", "US"), ("Toronto", "ON", "CA"), ("Lyon", "", "FR"),
          ("Munich", "", "DE"), ("Leeds", "", "GB"), ("Boise", "ID", "US"), ("Utrecht", "", "NL"),
          ("Calgary", "AB", "CA"), ("Porto", "", "PT"), ("Madison", "WI", "US"), ("Graz", "", "AT"))
PRODUCTS = ("Trail Running Shoe", "Merino Base Layer", "Down Jacket", "Rain Shell", "Hiking Boot",
            "Trekking Poles", "Sleeping Bag -5C", "Two-Person Tent", "Headlamp 400lm", "Water Filter",
            "Camp Stove", "Insulated Bottle", "Climbing Harness", "Daypack 24L", "Fleece Hoodie",
            "Wool Socks 3-pack", "Softshell Pants", "Bike Helmet", "Gaiters", "Compass")
CARRIERS = ("UPS", "DHL", "FedEx", "Canada Post", "DPD", "PostNL")
SERVICES = ("orders-api", "payments-api", "inventory-sync", "auth-gateway", "webhooks", "pricing")
LOG_MESSAGES = (
    "upstream timeout after 30000 ms calling {svc}", "invalid field shipping.postal_code: {code}",
    "rate limit exceeded for key {key}: 600 requests/min", "signature mismatch on webhook {key}",
    "order {order} rejected: sku {sku} not orderable in region {region}",
    "retrying payment capture for {order}",
    "token expired for key {key}", "idempotency key reused with a different body on {order}",
)
ARTICLES = ("How refunds reach your card", "Changing a delivery address", "Returning final-sale items",
            "Rotating API keys", "Understanding pending authorizations", "Lost parcel claims",
            "Membership tiers and return windows", "Webhook signatures", "Rate limits of the order API",
            "Exchanging a size", "Deleting your account", "Shipping to Europe: duties and taxes")


def _id(rng: random.Random, prefix: str, digits: int = 6) -> str:
    return f"{prefix}-{rng.randrange(10 ** (digits - 1), 10 ** digits)}"


def _when(rng: random.Random, month: int | None = None) -> str:
    month = month or rng.randint(1, 12)
    return (f"2024-{month:02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:"
            f"{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z")


def customer(rng: random.Random) -> dict:
    first, last = rng.choice(FIRST), rng.choice(LAST)
    city, region, country = rng.choice(CITIES)
    return {
        "customer_id": _id(rng, "C", 5), "name": f"{first} {last}",
        "email": f"{first.lower()}.{last.lower()}{rng.randint(1, 99)}@example.com",
        "tier": rng.choice(("basic", "basic", "silver", "gold", "platinum")), "created_at": _when(rng),
        "billing": {"city": city, "region": region, "country": country,
                    "postal_code": str(rng.randint(10000, 99999))},
        "cards": [{"brand": rng.choice(("visa", "mastercard", "amex")),
                   "last4": f"{rng.randint(0, 9999):04d}",
                   "expires": f"{rng.randint(1, 12):02d}/{rng.randint(25, 30)}"}],
        "verified_email": rng.random() < 0.9, "open_tickets": rng.randint(0, 3),
    }


def order_item(rng: random.Random) -> dict:
    return {"sku": _id(rng, "SKU", 5), "name": rng.choice(PRODUCTS),
            "size": rng.choice(("S", "M", "L", "XL", "42", "-")),
            "qty": rng.randint(1, 3), "unit_price": round(rng.uniform(9, 420), 2),
            "final_sale": rng.random() < 0.1}


def order(rng: random.Random, customer_id: str) -> dict:
    status = rng.choice(("processing", "shipped", "shipped", "delivered", "delivered", "cancelled",
                         "returned"))
    return {"order_id": _id(rng, "ORD"), "customer_id": customer_id, "placed_at": _when(rng),
            "status": status,
            "currency": rng.choice(("USD", "EUR", "CAD", "GBP")), "total": round(rng.uniform(15, 900), 2),
            "carrier": rng.choice(CARRIERS), "tracking_number": f"1Z{rng.randrange(16**12):012X}"}


def shipment_event(rng: random.Random) -> dict:
    city, _, country = rng.choice(CITIES)
    return {"time": _when(rng), "location": f"{city}, {country}",
            "status": rng.choice(("label created", "picked up", "in transit", "arrived at facility",
                                  "departed facility", "out for delivery", "delivery attempted",
                                  "delivered")),
            "facility": _id(rng, "HUB", 4)}


def log_entry(rng: random.Random) -> dict:
    template = rng.choice(LOG_MESSAGES)
    message = template.format(svc=rng.choice(SERVICES), code=rng.randint(100, 99999), key=_id(rng, "key", 8),
                              order=_id(rng, "ORD"), sku=_id(rng, "SKU", 5),
                              region=rng.choice(("EU", "US", "CA")))
    return {"time": _when(rng), "level": rng.choice(("INFO", "WARN", "ERROR", "ERROR")),
            "service": rng.choice(SERVICES), "request_id": f"req_{rng.randrange(16**16):016x}",
            "status": rng.choice((200, 400, 401, 429, 500, 502, 503)), "latency_ms": rng.randint(3, 30000),
            "message": message}


def search_hit(rng: random.Random) -> dict:
    title = rng.choice(ARTICLES)
    words = rng.sample(("refund", "card", "address", "carrier", "return", "label", "tier", "key", "webhook",
                        "limit", "statement", "duties", "size", "exchange", "account", "privacy"), 6)
    pairs = zip(words[::2], words[1::2], strict=True)
    clauses = (f"The {a} step applies when the {b} changes;" for a, b in pairs)
    return {"doc_id": _id(rng, "KB", 4), "title": title, "score": round(rng.uniform(0.3, 0.98), 3),
            "updated_at": _when(rng), "snippet": f"{title}: " + " ".join(clauses)}


def invoice_line(rng: random.Random) -> dict:
    return {"line_id": _id(rng, "LN", 5), "description": rng.choice(
                ("Pro membership renewal", "Order charge", "Shipping", "Duties and taxes", "Store credit",
                 "Pending authorization", "Refund")),
            "amount": round(rng.uniform(-120, 480), 2), "posted_at": _when(rng),
            "state": rng.choice(("settled", "settled", "pending", "reversed"))}


def stock_row(rng: random.Random) -> dict:
    city, _, country = rng.choice(CITIES)
    return {"warehouse": f"{city[:3].upper()}-{rng.randint(1, 9)}", "country": country,
            "on_hand": rng.randint(0, 400), "reserved": rng.randint(0, 60),
            "next_delivery": _when(rng) if rng.random() < 0.6 else None}


def ticket_note(rng: random.Random) -> dict:
    return {"note_id": _id(rng, "N", 5), "author": rng.choice(FIRST), "time": _when(rng),
            "text": rng.choice(("Customer called about the same order.", "Carrier claim filed.",
                                "Refund approved by supervisor.", "Waiting for the warehouse to confirm.",
                                "Asked the customer for photos of the damage.",
                                "Key rotated by the customer."))}


def incident(rng: random.Random) -> dict:
    return {"incident_id": _id(rng, "INC", 4), "component": rng.choice(("api", "storefront", "payments")),
            "opened_at": _when(rng), "state": rng.choice(("investigating", "monitoring", "resolved")),
            "summary": f"elevated {rng.choice((500, 502, 503, 504))} errors on {rng.choice(SERVICES)}"}


# tool name -> the list its result grows (key, maker); the header of each result is tool_header's
RESULT_LISTS = {
    "lookup_customer": ("recent_orders", None), "get_order": ("items", order_item),
    "list_orders": ("orders", None), "track_shipment": ("events", shipment_event),
    "search_logs": ("entries", log_entry), "search_knowledge_base": ("hits", search_hit),
    "get_invoice": ("lines", invoice_line), "check_inventory": ("warehouses", stock_row),
    "create_ticket": ("history", ticket_note), "get_service_status": ("incidents", incident),
    "issue_refund": ("ledger", invoice_line), "update_order": ("changes", ticket_note),
    "escalate_to_human": ("history", ticket_note),
}


def tool_header(rng: random.Random, tool: str, person: dict) -> dict:
    """The fixed part of a tool's result, before its growing list."""
    if tool == "lookup_customer":
        return {"status": "ok", "customer": person}
    if tool == "get_order":
        return {"status": "ok", **order(rng, person["customer_id"]), "payments": [
            {"method": f"card {person['cards'][0]['last4']}", "captured_at": _when(rng)}]}
    if tool == "track_shipment":
        return {"status": "ok", "carrier": rng.choice(CARRIERS),
                "tracking_number": f"1Z{rng.randrange(16**12):012X}"}
    if tool == "get_invoice":
        return {"status": "ok", "invoice_id": f"INV-2024-{rng.randint(1, 9999):04d}",
                "customer_id": person["customer_id"], "currency": rng.choice(("USD", "EUR"))}
    if tool == "check_inventory":
        return {"status": "ok", "sku": _id(rng, "SKU", 5), "name": rng.choice(PRODUCTS)}
    if tool == "issue_refund":
        return {"status": "refunded", "refund_id": _id(rng, "RF", 7),
                "amount": round(rng.uniform(10, 150), 2)}
    if tool == "create_ticket":
        return {"status": "created", "ticket_id": _id(rng, "T", 7),
                "queue": rng.choice(("orders", "billing", "api"))}
    return {"status": "ok", "customer_id": person["customer_id"]}


def list_item(rng: random.Random, tool: str, person: dict) -> dict:
    _, maker = RESULT_LISTS[tool]
    return order(rng, person["customer_id"]) if maker is None else maker(rng)
