"""What the generator feeds: SAE encoding, the activation store, ingest payloads and delivery."""
