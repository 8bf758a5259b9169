"""DeepSeek-V3: shapes (args), the model (multi-head latent attention, dense and mixture-of-experts blocks,
multi-token prediction), weight init, FLOP counts and the Hugging Face mapping. Its MoE layer and MTP modules are the
shared ones (titan/models/common/moe.py, mtp.py)."""

from titan.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args
from titan.models.deepseek_v3.init import init_weights
from titan.models.deepseek_v3.model import Transformer

__all__ = ["DEEPSEEK_V3_FLAVORS", "DeepSeekV3Args", "Transformer", "init_weights"]
