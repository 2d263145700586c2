"""The quickstart's ServerApp, audited from the server: the lines marked ``# leakaudit`` are all that is added.

``LeakAuditStrategy`` wraps the quickstart's FedAvg, aggregates as it does, and attacks each client's update
and their mean (what secure aggregation leaves the server) into ``runs/flower_app/server``. In simulation
the team gives it each client's training loader, the data the attacks are scored against.
"""
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from leakaudit.flower import LeakAuditStrategy  # leakaudit
from task import ITERATIONS, RUNS, Net, load_centralized_dataset, load_data, test

AUDIT = {"attacks": [{"name": "inverting_gradients", "params": {"iterations": ITERATIONS}}],  # leakaudit
         "mean": 0.5, "std": 0.5, "out": f"{RUNS}/server"}                                    # leakaudit
CLIENTS = 2  # the simulation's clients

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""
    fraction_evaluate = context.run_config.get("fraction-evaluate", 0.5)
    num_rounds = context.run_config.get("num-server-rounds", 2)
    lr = context.run_config.get("learning-rate", 0.01)
    batch_size = context.run_config.get("batch-size", 32)
    global_model = Net()
    arrays = ArrayRecord(global_model.state_dict())
    strategy = FedAvg(fraction_evaluate=fraction_evaluate)
    strategy = LeakAuditStrategy(strategy, Net(), lambda name: load_data(int(name), CLIENTS, batch_size)[0],  # leakaudit
                                 **AUDIT)                                                                    # leakaudit
    result = strategy.start(grid=grid, initial_arrays=arrays, train_config=ConfigRecord({"lr": lr}),
                            num_rounds=num_rounds, evaluate_fn=global_evaluate)
    print("\nSaving final model to disk...")
    state_dict = result.arrays.to_torch_state_dict()
    return state_dict


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Evaluate the global model on the server's own test set."""
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model.to(device)
    test_loss, test_acc = test(model, load_centralized_dataset(), device)
    return MetricRecord({"accuracy": test_acc, "loss": test_loss})
