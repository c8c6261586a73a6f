"""The built-in distillation prompts, composed from templates (written for this project).

They cover five kinds of agent traffic: code writing, JSON tool calls, summarization,
question answering over a given passage, and short explanations. Translation, math,
code editing, multi-turn sessions and open-ended writing are left out on purpose, so a
benchmark can show how a draft does on categories it was not trained on. The benchmark's
own prompt set is separate: none of these prompts appear in it.
"""

from __future__ import annotations

import json
import random

from specdec.train.data import Source

CODE_TASKS = [
    "checks whether a string is a palindrome", "merges two sorted lists", "counts the words in a text file",
    "returns the n-th Fibonacci number iteratively", "flattens a nested list",
    "parses a CSV line into fields", "removes duplicate items from a list while keeping their order",
    "computes the median of a list of numbers", "converts a Roman numeral to an integer",
    "validates an email address with a regular expression", "groups a list of dictionaries by a key",
    "finds the longest common prefix of several strings", "implements binary search on a sorted list",
    "reads a JSON file and returns the value at a dotted path",
    "retries a function call up to three times with exponential backoff",
    "chunks a list into batches of size n", "computes the SHA-256 hash of a file",
    "transposes a matrix given as a list of lists", "formats a number of seconds as HH:MM:SS",
    "counts the vowels in a string",
]
LANGUAGES = ["Python", "JavaScript", "Python", "Go", "Rust", "TypeScript", "Python", "Bash"]

TOOLS = [
    {"name": "get_weather", "description": "Current weather for a city",
     "parameters": {"city": "string", "unit": "celsius|fahrenheit"}},
    {"name": "search_web", "description": "Search the web",
     "parameters": {"query": "string", "max_results": "integer"}},
    {"name": "send_email", "description": "Send an email",
     "parameters": {"to": "string", "subject": "string", "body": "string"}},
    {"name": "create_event", "description": "Add a calendar event",
     "parameters": {"title": "string", "date": "YYYY-MM-DD", "time": "HH:MM", "duration_minutes": "integer"}},
    {"name": "get_stock_price", "description": "Latest price of a stock", "parameters": {"ticker": "string"}},
    {"name": "convert_currency", "description": "Convert money between currencies",
     "parameters": {"amount": "number", "from": "string", "to": "string"}},
    {"name": "read_file", "description": "Read a file from the workspace", "parameters": {"path": "string"}},
    {"name": "run_sql", "description": "Run a read-only SQL query", "parameters": {"query": "string"}},
]
TOOL_REQUESTS = [
    "What's the weather like in Lisbon right now, in celsius?",
    "Find me three articles about solar batteries.",
    "Email Dana at dana@example.com to say the report is ready.",
    "Put a 30 minute sync with the design team on 2024-05-14 at 10:00.", "How much is AAPL trading at?",
    "Convert 250 euros to Japanese yen.", "Show me what is in config/settings.yaml.",
    "How many orders were placed last week? The table is called orders and has a created_at column.",
    "Is it going to be cold in Oslo today? Use fahrenheit.",
    "Look up the latest news about the Mars sample return mission.",
    "Schedule a dentist appointment called 'Dentist' on 2024-06-02 at 15:30 for an hour.",
    "What is 99 US dollars in pounds?",
]

PASSAGES = [
    ("the history of the bicycle",
     "The first two-wheeled, rider-propelled machine was built by Karl Drais in 1817. It had no pedals: "
     "riders pushed off the ground with their feet. Pedals attached to the front wheel appeared in France in "
     "the 1860s, and the high-wheeled 'penny-farthing' followed because a larger front wheel went further "
     "per turn of the pedals. The safety bicycle of the 1880s, with a chain driving the rear wheel and two "
     "wheels of equal size, made cycling far less dangerous. Pneumatic tyres, patented by John Boyd Dunlop "
     "in 1888, made the ride comfortable, and within a decade bicycles had become a common means of "
     "transport in Europe and North America."),
    ("how vaccines work",
     "A vaccine trains the immune system to recognise a pathogen without causing the disease. It presents an "
     "antigen, such as an inactivated virus, a protein fragment or instructions to make that protein, and "
     "the body responds by producing antibodies and memory cells. If the real pathogen arrives later, memory "
     "cells recognise it quickly and the response is faster and stronger. Some vaccines need booster doses "
     "because memory fades, and vaccinating a large share of a population also protects people who cannot be "
     "vaccinated."),
    ("a company's quarterly report",
     "In the third quarter, revenue grew 12 percent to 48 million dollars, driven by subscriptions, which "
     "now make up 61 percent of sales. Hardware sales fell 8 percent as customers delayed upgrades. "
     "Operating costs rose 5 percent, mostly from hiring in the support team, and the operating margin "
     "improved from 14 to 18 percent. The company ended the quarter with 95 million dollars in cash and no "
     "debt, and it raised its full-year revenue forecast to between 185 and 190 million dollars."),
    ("coral reefs",
     "Coral reefs cover less than one percent of the ocean floor but shelter about a quarter of all marine "
     "species. Reef-building corals live in partnership with algae that photosynthesise and supply most of "
     "the coral's food. When water stays too warm for too long, corals expel the algae and turn white, an "
     "event called bleaching. Corals can recover if temperatures drop soon enough, but repeated bleaching "
     "kills them. Reefs also protect coastlines from waves and support fisheries that feed millions of "
     "people."),
    ("an incident report about a web service outage",
     "On Tuesday at 14:05 UTC the checkout service began returning errors for about 30 percent of requests. "
     "The cause was a configuration change that lowered the database connection pool from 200 to 20 "
     "connections. Alerts fired at 14:09, the on-call engineer identified the change at 14:31 and rolled it "
     "back at 14:37, and error rates returned to normal by 14:40. About 4,200 orders failed. Follow-up "
     "actions are to validate pool sizes in the deployment pipeline and to add an alert on connection wait "
     "time."),
    ("the water cycle",
     "Water evaporates from oceans, lakes and plants, rises as vapour and cools, condensing into clouds. "
     "When droplets grow heavy enough they fall as rain, snow or hail. Some of that water runs off into "
     "rivers and back to the sea, some soaks into the ground and refills aquifers, and some is stored for "
     "years in glaciers and ice caps. The sun's energy drives the whole cycle, and it moves heat around the "
     "planet as well as water."),
    ("remote work policy",
     "Employees may work remotely up to three days a week after their first three months. Teams agree on two "
     "core days when everyone is in the office. Remote days require a stable internet connection and "
     "availability on chat between 10:00 and 16:00. Equipment for a home office is reimbursed up to 500 "
     "euros once every three years. Managers review arrangements every six months, and fully remote "
     "contracts need approval from a director."),
    ("how a hash table works",
     "A hash table stores key-value pairs in an array of buckets. A hash function turns each key into an "
     "index, so lookups take constant time on average. Two keys can map to the same bucket; this collision "
     "is handled either by chaining, where each bucket holds a small list, or by open addressing, where the "
     "table probes for another free slot. When the table gets too full it is resized and every entry is "
     "rehashed, which keeps operations fast."),
]
QA_QUESTIONS = [
    "What is the main point of the passage?", "List the key numbers mentioned in the passage.",
    "What caused the problem described, and how was it fixed?",
    "According to the passage, why does this matter?",
    "Answer in one sentence: what happens first, according to the passage?",
    "What would you ask the author next?",
]

EXPLAIN_TOPICS = [
    "what an API rate limit is", "the difference between a process and a thread",
    "how HTTPS keeps data private", "what a JSON schema is used for", "why databases use indexes",
    "what a Docker container is", "how garbage collection works", "what an environment variable is",
    "the difference between TCP and UDP", "what a unit test is", "how a load balancer works",
    "what version control is for", "what caching is", "how public key cryptography works",
    "what a race condition is", "what a message queue does",
]
EXPLAIN_STYLES = ["Explain {t} in simple terms.", "Give a short explanation of {t}, with an example.",
                  "In three bullet points, explain {t}.", "Explain {t} to a new developer."]


def builtin_sources(seed: int = 0) -> list[Source]:
    """About 300 prompts, shuffled so that every tenth (held out) spans all kinds."""
    rng = random.Random(seed)
    out: list[Source] = []
    for i, task in enumerate(CODE_TASKS):
        for lang in (LANGUAGES[i % len(LANGUAGES)], LANGUAGES[(i + 3) % len(LANGUAGES)], "Python"):
            style = rng.choice(["Write a {l} function that {t}.",
                                "Write a {l} function that {t}. Add a docstring and a short example.",
                                "In {l}, implement a function that {t}. Keep it short."])
            out.append(Source(turns=[style.format(l=lang, t=task)], category="code"))
    for request in TOOL_REQUESTS:
        for n_tools in (3, 5, 8):
            tools = rng.sample(TOOLS, n_tools)
            prompt = (
                "You can call these tools:\n" + json.dumps(tools, indent=1) +
                '\nAnswer only with a JSON object {"name": ..., "arguments": {...}} '
                "that calls the right tool.\n\n"
                f"User request: {request}"
            )
            out.append(Source(turns=[prompt], category="tool_call"))
    for title, text in PASSAGES:
        for style in ("Summarize the following text about {t} in three sentences.",
                      "Write a one-paragraph summary of this text:",
                      "Summarize the key points as a bulleted list.",
                      "Give a short title and a two-sentence summary."):
            out.append(Source(turns=[f"{style.format(t=title)}\n\n{text}"], category="summarization"))
        for question in QA_QUESTIONS:
            turn = f"Read the passage and answer the question.\n\nPassage: {text}\n\nQuestion: {question}"
            out.append(Source(turns=[turn], category="qa"))
    for topic in EXPLAIN_TOPICS:
        for style in EXPLAIN_STYLES:
            out.append(Source(turns=[style.format(t=topic)], category="explain"))
    rng.shuffle(out)
    return out
