"""titan.exits: the one handler every entry point runs under. A rank whose collective fails because a peer
stopped with a known error exits with that peer's code and names it, instead of a gloo traceback."""

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from titan.config.errors import ConfigError
from titan.exits import run_main
from titan.parallel.dims import destroy_distributed
from titan.train.nan_guard import NonFiniteLossError

from harness.torchrun import spawn_ranks


def stopping_rank(rank: int, folder: str) -> None:
    """Rank 1 stops with a config mistake; rank 0 is inside a collective, waiting for it."""
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("titan").addHandler(handler)

    def body() -> None:
        if rank == 1:
            raise ConfigError("--training.dataset_path has no documents for data-parallel rank 1.")
        dist.all_reduce(torch.ones(1))  # fails once rank 1 has left the group

    code = run_main(body, on_exit=lambda ranks_agree: destroy_distributed(wait_for_peers=ranks_agree))
    Path(folder, f"rank{rank}.json").write_text(json.dumps({"code": code, "lines": lines}))


def test_peer_of_a_stopped_rank_names_it_and_exits_with_its_code(tmp_path: Path) -> None:
    spawn_ranks(stopping_rank, 2, str(tmp_path))
    stopped, peer = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (1, 0))
    assert stopped["code"] == 2 and "data-parallel rank 1" in stopped["lines"][0]
    assert peer["code"] == 2, peer
    assert len(peer["lines"]) == 1 and peer["lines"][0].startswith("Stopping because rank 1 stopped first"), peer


@pytest.mark.parametrize("error, code", [(ConfigError("bad flag"), 2), (NonFiniteLossError("loss is nan"), 3)])
def test_known_stops_return_their_code_and_say_whether_ranks_agree(error: Exception, code: int,
                                                                   titan_records: list[logging.LogRecord]) -> None:
    agreed: list[bool] = []

    def body() -> None:
        raise error

    assert run_main(body, on_exit=agreed.append) == code
    assert [r.getMessage() for r in titan_records] == [str(error)]
    # Every rank sees the same non-finite loss, so only then may ranks meet once more before leaving.
    assert agreed == [isinstance(error, NonFiniteLossError)]


def test_other_errors_keep_their_traceback() -> None:
    def body() -> None:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        run_main(body)
