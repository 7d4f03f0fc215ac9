#!/usr/bin/env node
// Example client of structgen.v1.GenerationService, loading the proto at run time.
//
//   node client.js [--server HOST:PORT (default $STRUCTGEN_SERVER or localhost:50051)] [--json-schema FILE | --regex RE | --choice A ...]
//                  [--chat] [--compact] [--token TOKEN] [--max-tokens N] [--temperature T] [--seed S]
//                  [--tools FILE] [--tool-choice none|auto|required|NAME] [--reasoning] [--reasoning-max-tokens N]
//                  [--max-whitespace N] PROMPT
//
// Streams the generated text to stdout; the final message (finish reason, usage, validation)
// goes to stderr as JSON. With --reasoning the model reasons first and its reasoning streams to
// stderr; with --tools (a JSON list of {name, description, parameters}; implies --chat) each
// parsed tool call is printed to stdout as one JSON line {id, name, arguments}. A failed call
// prints "error: <STATUS>: <message>" and exits 1; an output or a tool call the server found
// invalid against its JSON Schema, or one max_tokens cut short, exits 3 (as `structgen
// generate`); a file it cannot read exits 2.
'use strict';

const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO = path.join(__dirname, '..', '..', 'protos', 'structgen', 'v1', 'generation.proto');

function loadService() {
  const definition = protoLoader.loadSync(PROTO, {
    keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).structgen.v1.GenerationService;
}

class UsageError extends Error {}

// A file a flag names, read whole; a file that cannot be read (or parsed) is a usage error.
function readFlagFile(flag, file, parse = (text) => text) {
  try {
    return parse(fs.readFileSync(file, 'utf8'));
  } catch (error) {
    throw new UsageError(`${flag} ${file}: ${error.code ? `cannot read it (${error.code})` : error.message}`);
  }
}

function parseArgs(argv) {
  // The default server, as for `structgen generate`: $STRUCTGEN_SERVER, else localhost:50051.
  const options = { server: process.env.STRUCTGEN_SERVER || 'localhost:50051', choices: [], maxTokens: 0 };
  const positional = [];
  for (let i = 0; i < argv.length; i++) {
    const flag = argv[i];
    const value = () => argv[++i];
    if (flag === '--server') options.server = value();
    else if (flag === '--json-schema') options.jsonSchema = readFlagFile(flag, value());
    else if (flag === '--regex') options.regex = value();
    else if (flag === '--choice') options.choices.push(value());
    else if (flag === '--compact') options.compact = true;
    else if (flag === '--chat') options.chat = true;
    else if (flag === '--token') options.token = value();
    else if (flag === '--max-tokens') options.maxTokens = Number(value());
    else if (flag === '--temperature') options.temperature = Number(value());
    else if (flag === '--seed') options.seed = Number(value());
    else if (flag === '--max-whitespace') options.maxWhitespace = Number(value());
    else if (flag === '--tools') options.tools = readFlagFile(flag, value(), JSON.parse);
    else if (flag === '--tool-choice') options.toolChoice = value();
    else if (flag === '--reasoning') options.reasoning = true;
    else if (flag === '--reasoning-max-tokens') options.reasoningMaxTokens = Number(value());
    else positional.push(flag);
  }
  options.prompt = positional.join(' ');
  return options;
}

const TOOL_CHOICE_MODES = { none: 'TOOL_CHOICE_MODE_NONE', auto: 'TOOL_CHOICE_MODE_AUTO', required: 'TOOL_CHOICE_MODE_REQUIRED' };

function buildRequest(options) {
  const request = { sampling: {}, stop: { max_tokens: options.maxTokens } };
  // --chat: the prompt is one user message, formatted by the model's chat template (which
  // also shows the tools to the model).
  if (options.chat || options.tools) request.chat = { messages: [{ role: 'user', content: options.prompt }] };
  else request.prompt = options.prompt;
  if (options.tools) {
    // Tool.parameters is the JSON Schema of the arguments as JSON text.
    request.tools = options.tools.map((tool) => ({
      name: tool.name, description: tool.description || '', parameters: tool.parameters ? JSON.stringify(tool.parameters) : '',
    }));
  }
  if (options.toolChoice) {
    const mode = TOOL_CHOICE_MODES[options.toolChoice];
    request.tool_choice = mode ? { mode } : { mode: 'TOOL_CHOICE_MODE_NAMED', name: options.toolChoice };
  }
  if (options.reasoning) {
    // A free reasoning span first; max_tokens caps it (then the end marker is forced).
    request.reasoning = { mode: 'REASONING_MODE_ENABLED' };
    if (options.reasoningMaxTokens !== undefined) request.reasoning.max_tokens = options.reasoningMaxTokens;
  }
  // Unset sampling fields take the server's defaults (greedy unless configured).
  if (options.temperature !== undefined) request.sampling.temperature = options.temperature;
  if (options.seed !== undefined) request.sampling.seed = options.seed;
  if (options.jsonSchema) request.json_schema = options.jsonSchema;
  else if (options.regex) request.regex = options.regex;
  else if (options.choices.length) request.choice = { choices: options.choices };
  // JSON without free whitespace between tokens; or at most N whitespace characters in a row.
  if (options.compact) request.constraint_options = { compact: true };
  else if (options.maxWhitespace !== undefined) request.constraint_options = { max_whitespace: options.maxWhitespace };
  return request;
}

function main() {
  let options;
  try {
    options = parseArgs(process.argv.slice(2));
  } catch (error) {
    if (!(error instanceof UsageError)) throw error;
    process.stderr.write(`error: ${error.message}\n`);
    process.exitCode = 2;
    return;
  }
  const GenerationService = loadService();
  const client = new GenerationService(options.server, grpc.credentials.createInsecure());
  // Servers started with --auth-token-file want "authorization: Bearer <token>".
  const metadata = new grpc.Metadata();
  if (options.token) metadata.add('authorization', `Bearer ${options.token}`);
  const call = client.Generate(buildRequest(options), metadata);
  call.on('data', (response) => {
    if (response.reasoning_text) process.stderr.write(response.reasoning_text);
    process.stdout.write(response.text);
    for (const toolCall of response.tool_calls) {
      const { id, name, arguments: args, validation } = toolCall;
      process.stdout.write(JSON.stringify({ id, name, arguments: JSON.parse(args) }) + '\n');
      if (validation && validation.status === 'VALIDATION_STATUS_INVALID') process.exitCode = 3;
    }
    if (response.finish_reason !== 'FINISH_REASON_UNSPECIFIED') {
      const { finish_reason, usage, validation } = response;
      process.stderr.write(JSON.stringify({ finish_reason, usage, validation }) + '\n');
      if (validation && validation.status === 'VALIDATION_STATUS_INVALID') process.exitCode = 3;
      // max_tokens cut a tool call or the JSON document short: say so (and exit 3)
      const cut = response.incomplete_tool_call ? 'a tool call' : validation && validation.truncated ? 'the JSON document' : '';
      if (cut) {
        process.stderr.write(`error: ${cut} was cut short at ${usage.completion_tokens} tokens (max_tokens); raise --max-tokens\n`);
        process.exitCode = 3;
      }
    }
  });
  call.on('error', (error) => {
    process.stderr.write(`error: ${grpc.status[error.code]}: ${error.details}\n`);
    process.exitCode = 1;
  });
  call.on('end', () => {
    process.stdout.write('\n');
    client.close();
  });
}

main();
