"""Prefill/decode disaggregation: moving a request's caches between two engines.

A producer (prefill node) runs the prompt, samples the first token and holds the
request's KV blocks and KDA state slot; a consumer (decode node) reads them into its
own caches over a transfer engine and decodes (docs/pd.md). The pieces:

- `config.py`: `--kv-transfer-config`, parsed and checked.
- `regions.py`: a rank's caches as named regions and the layout fingerprint that
  both sides compare at the handshake.
- `connector.py`: the connector interface (scheduler side in the engine process,
  worker side in every rank) and the messages between its halves.
- `mooncake_connector.py`: that interface over Mooncake's transfer engine.
- `factory.py`: connectors by `kv_connector` name.
- `peer.py`: the HTTP side channel to the producer (layout, release).
"""
