"""The offline worlds the project runs and tests in: nothing here is part of the algorithm.

`worlds.tiny_world` builds the default run's task and its tiny trained models (assets/tiny, assets/trace);
`worlds.tiny_families` builds tiny random stand-ins of the model families gndpo_minimal.py trains;
`worlds.tokenizer` trains the byte-level BPE tokenizer both of them use.
"""
