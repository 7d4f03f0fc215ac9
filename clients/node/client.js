#!/usr/bin/env node
// Example client of structgen.v1.GenerationService, loading the proto at run time.
//
//   node client.js [--server HOST:PORT (default $STRUCTGEN_SERVER or localhost:50051)] [--json-schema FILE | --regex RE | --choice A ...]
//                  [--chat] [--compact] [--token TOKEN] [--max-tokens N] [--temperature T] [--seed S] PROMPT
//
// Streams the generated text to stdout; the final message (finish reason, usage, validation)
// goes to stderr as JSON. A failed call prints "error: <STATUS>: <message>" and exits 1; an
// output the server found invalid against its JSON Schema exits 3 (as `structgen generate`).
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

function parseArgs(argv) {
  // The default server, as for `structgen generate`: $STRUCTGEN_SERVER, else localhost:50051.
  const options = { server: process.env.STRUCTGEN_SERVER || 'localhost:50051', choices: [], maxTokens: 0 };
  const positional = [];
  for (let i = 0; i < argv.length; i++) {
    const flag = argv[i];
    const value = () => argv[++i];
    if (flag === '--server') options.server = value();
    else if (flag === '--json-schema') options.jsonSchema = fs.readFileSync(value(), 'utf8');
    else if (flag === '--regex') options.regex = value();
    else if (flag === '--choice') options.choices.push(value());
    else if (flag === '--compact') options.compact = true;
    else if (flag === '--chat') options.chat = true;
    else if (flag === '--token') options.token = value();
    else if (flag === '--max-tokens') options.maxTokens = Number(value());
    else if (flag === '--temperature') options.temperature = Number(value());
    else if (flag === '--seed') options.seed = Number(value());
    else positional.push(flag);
  }
  options.prompt = positional.join(' ');
  return options;
}

function buildRequest(options) {
  const request = { sampling: {}, stop: { max_tokens: options.maxTokens } };
  // --chat: the prompt is one user message, formatted by the model's chat template.
  if (options.chat) request.chat = { messages: [{ role: 'user', content: options.prompt }] };
  else request.prompt = options.prompt;
  // Unset sampling fields take the server's defaults (greedy unless configured).
  if (options.temperature !== undefined) request.sampling.temperature = options.temperature;
  if (options.seed !== undefined) request.sampling.seed = options.seed;
  if (options.jsonSchema) request.json_schema = options.jsonSchema;
  else if (options.regex) request.regex = options.regex;
  else if (options.choices.length) request.choice = { choices: options.choices };
  // JSON without free whitespace between tokens.
  if (options.compact) request.constraint_options = { compact: true };
  return request;
}

function main() {
  const options = parseArgs(process.argv.slice(2));
  const GenerationService = loadService();
  const client = new GenerationService(options.server, grpc.credentials.createInsecure());
  // Servers started with --auth-token-file want "authorization: Bearer <token>".
  const metadata = new grpc.Metadata();
  if (options.token) metadata.add('authorization', `Bearer ${options.token}`);
  const call = client.Generate(buildRequest(options), metadata);
  call.on('data', (response) => {
    process.stdout.write(response.text);
    if (response.finish_reason !== 'FINISH_REASON_UNSPECIFIED') {
      const { finish_reason, usage, validation } = response;
      process.stderr.write(JSON.stringify({ finish_reason, usage, validation }) + '\n');
      if (validation && validation.status === 'VALIDATION_STATUS_INVALID') process.exitCode = 3;
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
