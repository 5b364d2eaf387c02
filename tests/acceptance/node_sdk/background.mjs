// The official `openai` Node SDK against `backfill up`, as a user writes it: background responses
// at the gateway (create -> retrieve / stream -> cancel, and a stream from create) and a flex call
// at the router. Run by tests/acceptance/test_node_sdk.py; prints one JSON line per check and exits
// 1 when one failed.
//   GATEWAY_URL, ROUTER_URL (both ending in /v1), API_KEY, MODEL
import OpenAI from "openai";

const { GATEWAY_URL, ROUTER_URL, API_KEY, MODEL } = process.env;
const gateway = new OpenAI({ baseURL: GATEWAY_URL, apiKey: API_KEY, maxRetries: 0 });
const router = new OpenAI({ baseURL: ROUTER_URL, apiKey: API_KEY, maxRetries: 0 });
let failed = 0;

function check(name, ok, detail) {
  if (!ok) failed += 1;
  console.log(JSON.stringify({ check: name, ok: Boolean(ok), detail }));
}

async function untilEnded(id, timeoutMs = 60000) {
  const deadline = Date.now() + timeoutMs;
  const seen = [];
  for (;;) {
    const response = await gateway.responses.retrieve(id);
    if (seen.at(-1) !== response.status) seen.push(response.status);
    if (!["queued", "in_progress"].includes(response.status)) return { response, seen };
    if (Date.now() > deadline) throw new Error(`${id} still ${response.status}`);
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
}

async function collect(stream) {
  const events = [];
  for await (const event of stream) events.push(event);
  return events;
}

async function main() {
  const created = await gateway.responses.create({
    model: MODEL, input: "Tell me about otters.", background: true, max_output_tokens: 16,
  });
  check("create answers queued", created.status === "queued" && created.background === true &&
        created.id.startsWith("resp_"), { status: created.status, background: created.background });

  const { response: done, seen } = await untilEnded(created.id);
  check("retrieve until it ends", ["completed", "incomplete"].includes(done.status) && done.output_text.length > 0 &&
        done.usage.output_tokens > 0, { seen, status: done.status });

  const events = await collect(await gateway.responses.retrieve(created.id, { stream: true }));
  const deltas = events.filter((e) => e.type === "response.output_text.delta").map((e) => e.delta).join("");
  check("stream the stored events", events[0].type === "response.created" &&
        events.at(-1).type === `response.${done.status}` && deltas === done.output_text &&
        events.every((e, i) => e.sequence_number === i), { types: [...new Set(events.map((e) => e.type))] });

  const later = await collect(await gateway.responses.retrieve(created.id, { stream: true, starting_after: events.length - 2 }));
  check("stream with starting_after", later.length === 1 && later[0].type === `response.${done.status}`,
        { types: later.map((e) => e.type) });

  const live = await collect(await gateway.responses.create({
    model: MODEL, input: "Stream it from create.", background: true, stream: true, max_output_tokens: 8,
  }));
  const liveText = live.filter((e) => e.type === "response.output_text.delta").map((e) => e.delta).join("");
  const liveEnd = live.at(-1);
  check("stream from create", live[0].type === "response.created" && live[0].response.status === "queued" &&
        live[0].response.background === true && ["response.completed", "response.incomplete"].includes(liveEnd.type) &&
        liveText === liveEnd.response.output.flatMap((item) => item.content ?? []).map((part) => part.text).join(""),
        { types: [...new Set(live.map((e) => e.type))] });

  const items = await gateway.responses.create({
    model: MODEL, background: true, max_output_tokens: 8,
    input: [{ type: "message", role: "user", content: [{ type: "input_text", text: "Input items, list form." }] }],
  });
  const { response: itemsDone } = await untilEnded(items.id);
  check("input as input items", ["completed", "incomplete"].includes(itemsDone.status), { status: itemsDone.status });

  const long = await gateway.responses.create({
    model: MODEL, input: "Write a very long novel about otters in space.", background: true, max_output_tokens: 4000,
  });
  const cancelled = await gateway.responses.cancel(long.id);
  const other = await gateway.responses.create({ model: MODEL, input: "Hi", background: true, max_output_tokens: 4 });
  await untilEnded(other.id);
  const after = await gateway.responses.retrieve(long.id);
  check("cancel sticks", cancelled.status === "cancelled" && after.status === "cancelled", { status: after.status });

  const flex = await router.chat.completions.create(
    { model: MODEL, messages: [{ role: "user", content: "A flex call." }], max_tokens: 8, service_tier: "flex" },
    { timeout: 15 * 60 * 1000 },
  );
  check("flex chat completion", flex.service_tier === "flex" && flex.choices[0].message.content.length > 0,
        { service_tier: flex.service_tier });

  const flexResponse = await router.responses.create(
    { model: MODEL, input: "A flex response.", max_output_tokens: 8, service_tier: "flex", store: false },
    { timeout: 15 * 60 * 1000 },
  );
  check("flex response", flexResponse.service_tier === "flex" && flexResponse.output_text.length > 0,
        { service_tier: flexResponse.service_tier });
}

try {
  await main();
} catch (error) {
  failed += 1;
  console.log(JSON.stringify({ check: "no exception", ok: false, detail: String(error?.stack ?? error) }));
}
process.exit(failed ? 1 : 0);
