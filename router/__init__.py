"""OpenAI-compatible inference router in front of vLLM engines.

``router.fleet`` holds the vLLM engine simulator and the launch settings of real vLLM engines.
"""
