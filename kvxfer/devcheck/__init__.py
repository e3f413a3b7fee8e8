"""``kvxfer devcheck``: the one prepared check of everything only a GPU can show.

Runs where it will run: the lent machine has torch, triton, cuda-bindings, xxhash,
numpy and pytest but not the daemon's gRPC packages, and the project is used from
its checkout (``PYTHONPATH=.``). So nothing here imports gRPC. Each stage's result
is written to ``DIR/devcheck.json`` as soon as it is known: a time-out still leaves
the stages before it. Without a GPU it prints one line and exits 3.
"""
