"""The OpenAI-compatible HTTP server: ``protocol`` (request bodies), ``serving`` (the work), ``api_server`` (the app
and ``jaxllm serve``)."""
