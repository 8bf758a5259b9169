"""How fast conversations become a chat store's tokens and roles: ConversationEncoder.encode over the shipped
conversations, with Titan's default template (its {% generation %} blocks) and with the same template without
blocks (markers, titan/data/turns.py). Prints tokens per second, best of --repeats rounds (docs/sft.md)."""

import argparse
import re
import time

from titan.data.chat_template import ChatTemplate, load_chat_template
from titan.data.conversations import ConversationEncoder, read_jsonl_rows
from titan.data.dataset import SHIPPED_CORPUS
from titan.data.tokenizer import SHIPPED_TOKENIZER, build_tokenizer

GENERATION_TAGS = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokenizer = build_tokenizer(SHIPPED_TOKENIZER)
    template = load_chat_template("", tokenizer)
    unmarked = ChatTemplate(GENERATION_TAGS.sub("", template.source), "without blocks", template.special_tokens)
    rows = list(read_jsonl_rows(SHIPPED_CORPUS.parent / "stdlib_chats.jsonl.gz", "messages", "shipped chats"))
    for name, chosen in (("generation blocks", template), ("markers (no blocks)", unmarked)):
        encoder = ConversationEncoder(chosen, tokenizer, "messages")
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            num_tokens = sum(len(encoder.encode(row)[0]) for row in rows)
            best = min(best, time.perf_counter() - start)
        print(f"{name}: {len(rows)} conversations, {num_tokens:,} tokens, {num_tokens / best / 1e6:.2f}M tokens/s")


if __name__ == "__main__":
    main()
