"""The vocabulary the schema tests run on: Mistral's real 32k SentencePiece tokenizer."""
VOCAB = 32768  # logits width the masks cover
EOS = 2        # </s>
