"""Benchmarks and load tests: programs that print a table, write JSON (and a
plot where a picture says more) and compare against a baseline measured in
the same run. None of them asserts a time.

    offline.py   ``bench offline``: our engine vs Hugging Face static batching
    kernels.py   ``bench kernels``: the linear-layer backends on the model's shapes
    latency.py   ``bench latency``: decode step and prefill times (step_profile.py: where
                 a step goes; llama_cpp_peer.py: llama.cpp on the same weights)
    serve.py     ``bench serve``: the serving benchmark (as ``vllm bench serve``)
    datasets.py, clients.py, metrics.py   its workloads, gRPC / OpenAI clients, figures
    routing.py   ``bench routing``: one multi-tenant workload per routing policy
    router.py    ``bench router``: the router's own cost (decision, routed req/s)
    soak.py      ``soak``: bounded mixed load with client faults; leak check
"""
