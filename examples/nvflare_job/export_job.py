"""Export the job beside this file with NVIDIA FLARE's own job API, as FLARE's example
fedavg_script_runner_dp_filter_cifar10.py builds it, with MediSwarm's PercentilePrivacy (percentile 10, gamma 0.01) on
every site's train result; each site sends the model's change (params_transfer_type DIFF), what the filter is meant for.

    python export_job.py            # writes job/ (meta.json, app_server/, app_site-1/, app_site-2/); offline
"""
import os
import sys
from pathlib import Path

from nvflare import FilterType
from nvflare.app_common.filters.percentile_privacy import PercentilePrivacy
from nvflare.app_opt.pt.job_config.fed_avg import FedAvgJob
from nvflare.client.config import TransferType
from nvflare.job_config.script_runner import ScriptRunner

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from net import Net  # noqa: E402


def export(out: Path) -> Path:
    """The job, exported under ``out``; its folder."""
    os.chdir(HERE)  # the script named as FLARE's examples name it, relative to the job's sources
    job = FedAvgJob(name="job", num_rounds=2, n_clients=2, initial_model=Net())
    for i in (1, 2):
        site = f"site-{i}"
        job.to(ScriptRunner(script="train.py", params_transfer_type=TransferType.DIFF), site,
               tasks=["train"])
        job.to(PercentilePrivacy(percentile=10, gamma=0.01), site, tasks=["train"], filter_type=FilterType.TASK_RESULT)
    job.export_job(str(out))
    return out / "job"


if __name__ == "__main__":
    print(export(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else HERE))
