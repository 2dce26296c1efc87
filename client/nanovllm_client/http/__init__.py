"""An OpenAI-compatible HTTP front for the service (`pip install 'nanovllm-client[http]'`).

It is a client of the service (the async client), so it imports no torch and may run on
another host than the stages. `python -m nanovllm_client.http --help`.
"""
