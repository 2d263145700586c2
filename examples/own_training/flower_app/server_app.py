"""The quickstart's ServerApp, audited from the server: the lines marked ``# leakaudit`` are all that is added.

``LeakAuditStrategy`` wraps the quickstart's FedAvg, aggregates as it does, and attacks each client's update
and their mean (what secure aggregation leaves the server) into ``runs/flower_app/server``. In simulation
the team gives it each client's training loader, the data the attacks are scored against.
"""
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from leakaudit.flower import LeakAuditStrategy  # leakaudit
from task import IMAGES, ITERATIONS, RUNS, Net, load_data

AUDIT = {"attacks": [{"name": "inverting_gradients", "params": {"iterations": ITERATIONS}}],  # leakaudit
         "mean": 0.5, "std": 0.5, "out": f"{RUNS}/server"}                                    # leakaudit
CLIENTS = 2  # the simulation's clients

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""
    fraction_train = context.run_config.get("fraction-train", 1.0)
    num_rounds = context.run_config.get("num-server-rounds", 2)
    lr = context.run_config.get("lr", 0.01)
    global_model = Net()
    arrays = ArrayRecord(global_model.state_dict())
    strategy = FedAvg(fraction_train=fraction_train, fraction_evaluate=0.0)
    strategy = LeakAuditStrategy(strategy, Net(), lambda name: load_data(int(name), CLIENTS, IMAGES)[0],  # leakaudit
                                 **AUDIT)                                                             # leakaudit
    result = strategy.start(grid=grid, initial_arrays=arrays, train_config=ConfigRecord({"lr": lr}),
                            num_rounds=num_rounds)
    print("\nSaving final model to disk...")
    state_dict = result.arrays.to_torch_state_dict()
    return state_dict
