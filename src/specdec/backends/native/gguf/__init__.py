"""GGUF files as they are: reading a file's config and tensors (reader.py), the layers over its
blocks (layers.py), the native model's state from them (state.py), and an encoder of floats
into the block formats for synthetic files (encode.py)."""
