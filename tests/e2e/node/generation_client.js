// MILI's public API from Node, as a backend team calls it: @grpc/grpc-js with the protos loaded
// at run time by @grpc/proto-loader. Prints one JSON object: a streamed greedy Generate and the
// INVALID_ARGUMENT of a bad top_p with its google.rpc.BadRequest decoded.
//
//   node generation_client.js HOST:PORT GOOGLEAPIS_DIR
//
// GOOGLEAPIS_DIR holds google/rpc/status.proto and error_details.proto (googleapis; the Python
// package googleapis-common-protos ships them): MILI's protos do not import them, its errors do.
'use strict';
const path = require('path');
const grpc = require('@grpc/grpc-js');
const loader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

const [address, googleapis] = process.argv.slice(2);
const protos = path.resolve(__dirname, '..', '..', '..', 'protos');
const definition = loader.loadSync('mili/frontend/v1/generation.proto', {
  keepCase: true, enums: String, defaults: true, includeDirs: [protos],
});
const { GenerationService } = grpc.loadPackageDefinition(definition).mili.frontend.v1;
const client = new GenerationService(address, grpc.credentials.createInsecure());

const rpc = new protobuf.Root();
rpc.resolvePath = (origin, target) => path.join(googleapis, target);
rpc.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto'], { keepCase: true });

function generate(request) {
  return new Promise((resolve, reject) => {
    const result = { token_ids: [], text: '' };
    const call = client.Generate(request, { deadline: Date.now() + 60_000 });
    call.on('data', (message) => {
      result.token_ids.push(...message.token_ids);
      result.text += message.text;
      if (message.usage) Object.assign(result, { finish_reason: message.finish_reason, usage: message.usage });
    });
    call.on('error', reject);
    call.on('end', () => resolve(result));
  });
}

// The error's google.rpc.Status travels in the grpc-status-details-bin trailer.
function badRequest(error) {
  const [bytes] = error.metadata.get('grpc-status-details-bin');
  const status = rpc.lookupType('google.rpc.Status').decode(bytes);
  const detail = status.details.find((any) => any.type_url.endsWith('/google.rpc.BadRequest'));
  const violations = rpc.lookupType('google.rpc.BadRequest').decode(detail.value).field_violations;
  return { code: grpc.status[error.code], fields: violations.map((v) => v.field) };
}

async function main() {
  const sampling = { max_tokens: 12, temperature: 0, ignore_eos: true };
  const generated = await generate({ prompt: 'Hello', sampling });
  const error = await generate({ prompt: 'Hello', sampling: { top_p: 2 } }).then(
    () => ({ code: 'OK' }), badRequest);
  console.log(JSON.stringify({ generated, error }));
  client.close();
}
main().catch((error) => { console.error(error); process.exit(1); });
