import runpy, sys, os
sys.argv = ["w6_structured.py"]
if os.environ.get("NO_HELPER"):
    import asyncllm.sample.structured as st
    st.HELPER_MIN_ROWS = 10**9
runpy.run_path("w6_structured.py", run_name="__main__")
