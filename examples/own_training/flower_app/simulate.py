"""Run the audited quickstart app in Flower's simulation engine, offline, in this process (the folder is also a
Flower App: ``flwr run . --stream`` runs it on a local SuperLink, docs/own-training.md "With flwr run"):

    pip install 'leakaudit[flower]'
    cd examples/own_training/flower_app && python simulate.py

Both sides write run folders (``runs/flower_app/clients/client-N``, ``runs/flower_app/server/...``); each
audited round's verdict is printed as it is judged, and ``leakaudit report FOLDER`` renders any of them.
"""
from __future__ import annotations

import os

from flwr.simulation import run_simulation

from client_app import app as client_app
from server_app import CLIENTS
from server_app import app as server_app


def main() -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # Flower's simulation starts Ray: keep it offline
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=CLIENTS,
                   backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}})


if __name__ == "__main__":
    main()
