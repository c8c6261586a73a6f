"""The Python API: speculative decoding on the embedded model, one reply whole and one streamed.

    python examples/quickstart.py
"""

from specdec import Engine

engine = Engine(target="smollm2-135m", drafter="suffix", k="auto", backend="native")
result = engine.generate("Write a haiku about caches.", max_new_tokens=64, stop=["\n\n"])
print(result.text)
print(result.stats.summary())  # steps, drafted and accepted tokens, tokens_per_second, ...
for delta in engine.stream("Explain KV caches briefly.", max_new_tokens=64, temperature=0.7, top_p=0.9, seed=1):
    print(delta, end="", flush=True)
print()
