"""The training data loader: batches of packed token windows, resumable through its state_dict()."""

import warnings

from torchdata.stateful_dataloader import StatefulDataLoader

from titan.config.job import Training
from titan.data.dataset import PackedTokenDataset, build_document_source
from titan.data.tokenizer import Tokenizer

# torchdata 0.11 calls torch.set_vital on every iteration, which torch 2.13 deprecates with a UserWarning
# per epoch; the call is harmless and not ours to fix.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


def build_dataloader(tokenizer: Tokenizer, training: Training, dp_rank: int, dp_world_size: int) -> StatefulDataLoader:
    """Yields (inputs, labels), both int64 of shape (local_batch_size, seq_len), from this rank's shard.

    Its state_dict() holds the dataset's position, so a checkpoint resumes the exact batch sequence."""
    dataset = PackedTokenDataset(build_document_source(training), tokenizer, training.seq_len, dp_rank,
                                 dp_world_size)
    # Tokenizing in the main process keeps the state exact and is fast next to a training step.
    return StatefulDataLoader(dataset, batch_size=training.local_batch_size, num_workers=0)
