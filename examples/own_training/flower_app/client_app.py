"""The quickstart's ClientApp, audited on the client: the lines marked ``# leakaudit`` are all that is added.

Each round's update is attacked before the reply leaves the client (``LeakAuditMod``), into
``runs/flower_app/clients/client-N``; a round over more than 64 images is attacked on a seeded sample of
its minibatches. The app's own privacy, Flower's ``LocalDpMod``, runs inside the audit (``mods=[DP]``): the round
is audited under that mechanism (``flower_local_dp``), with its likelihood and the epsilon it really spends. Its
settings are FLIP's shipped defaults (sensitivity 1e-4 beside clipping_norm 1.0): the report's privacy table warns
that the noise is orders of magnitude under the update.
"""
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import LocalDpMod

from leakaudit.flower import LeakAuditMod  # leakaudit
from task import ITERATIONS, RUNS, Net, load_data
from task import test as test_fn
from task import train as train_fn

AUDIT = {"attacks": [{"name": "inverting_gradients", "params": {"iterations": ITERATIONS}}],  # leakaudit
         "mean": 0.5, "std": 0.5, "out": f"{RUNS}/clients"}                                   # leakaudit

DP = LocalDpMod(clipping_norm=1.0, sensitivity=1e-4, epsilon=10.0, delta=1e-5)  # the app's own local DP
app = ClientApp(mods=[LeakAuditMod(Net, mods=[DP], **AUDIT)])  # leakaudit: was ClientApp(), @app.train(mods=[DP])


@app.train()
def train(msg: Message, context: Context):
    """Train the model on local data."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model.to(device)
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    trainloader, _ = load_data(partition_id, num_partitions, context.run_config.get("batch-size", 32))
    train_loss = train_fn(model, trainloader, context.run_config.get("local-epochs", 1),
                          msg.content["config"]["lr"], device)
    model_record = ArrayRecord(model.state_dict())
    metrics = {"train_loss": train_loss, "num-examples": len(trainloader.dataset),
               "partition": partition_id}  # leakaudit: names the client to the server's audit
    content = RecordDict({"arrays": model_record, "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context):
    """Evaluate the model on local data."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model.to(device)
    _, valloader = load_data(context.node_config["partition-id"], context.node_config["num-partitions"],
                             context.run_config.get("batch-size", 32))
    eval_loss, eval_acc = test_fn(model, valloader, device)
    metrics = {"eval_loss": eval_loss, "eval_acc": eval_acc, "num-examples": len(valloader.dataset)}
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
