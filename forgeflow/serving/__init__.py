"""Serving a GGUF: the model server base and llama-cpp-python backend (``server``), llama.cpp's
``llama_server``, an OpenAI-compatible endpoint forgeflow does not start (``external``: its probe and
checks), the backend choice (``backend``), the serving gate (``health``), a multimodal model's projector
and image smoke (``multimodal``) and the blue/green swap with its
state file (``bluegreen``)."""
