// run.mjs: Graphile Worker as a system under test of bench/pipeline, started by the benchmark
// (systems.go) as
//
//   node run.mjs migrate -dsn DSN
//   node run.mjs run -dsn DSN -config default|tuned [-processes N] [-concurrency N]
//                    [-local-queue N] [-stamp FILE]
//
// `migrate` installs Graphile Worker's schema and exits. `run` starts N runners (one in this
// process when N is 1; otherwise N child processes of this one, each its own runner and pool,
// as Graphile's performance page runs several instances), prints "ready" on stdout once every
// runner works, runs until SIGTERM or SIGINT, stops the runners gracefully and, with -stamp,
// writes "KEY UNIXNANO" lines: when each message's first stage began, by this machine's clock.
//
// The one task, "noop", does nothing but, for a stage before the last of a pipeline, add the
// job of the next stage (helpers.addJob: its own statement, not the completion's transaction,
// as River's Work does in the bench). Payload: {msg, stage, last}.
import { fork } from "node:child_process";
import { writeFileSync, readFileSync, existsSync, unlinkSync } from "node:fs";
import { fileURLToPath } from "node:url";
import { performance } from "node:perf_hooks";
import pg from "pg";
import { Logger, run, runMigrations } from "graphile-worker";

const args = parseArgs(process.argv.slice(2));

// parseArgs reads "CMD -flag value ..." (the Go flag style the benchmark uses).
function parseArgs(argv) {
  const out = { cmd: argv[0], processes: 1, config: "default", concurrency: 0, localQueue: 0 };
  for (let i = 1; i < argv.length; i += 2) {
    const k = argv[i].replace(/^-+/, "");
    const v = argv[i + 1];
    switch (k) {
      case "dsn": out.dsn = v; break;
      case "config": out.config = v; break;
      case "processes": out.processes = Number(v); break;
      case "concurrency": out.concurrency = Number(v); break;
      case "local-queue": out.localQueue = Number(v); break;
      case "stamp": out.stamp = v; break;
      case "child": out.child = Number(v); i--; break; // internal: no value
      default: throw new Error(`run.mjs: unknown flag -${k}`);
    }
  }
  return out;
}

// pgConfig turns a libpq key=value DSN (what the benchmark's cluster prints: host is a socket
// directory) into node-postgres' configuration.
function pgConfig(dsn) {
  const c = {};
  for (const kv of (dsn || "").trim().split(/\s+/)) {
    const [k, v] = [kv.slice(0, kv.indexOf("=")), kv.slice(kv.indexOf("=") + 1)];
    if (k === "host") c.host = v;
    if (k === "port") c.port = Number(v);
    if (k === "user") c.user = v;
    if (k === "dbname") c.database = v;
    if (k === "password") c.password = v;
  }
  return c;
}

// workerOptions are the preset.worker settings of a configuration. default: Graphile Worker's
// own defaults (concurrentJobs 1, maxPoolSize 10, pollInterval 2 s, no local queue, no batched
// completion). tuned: its performance page's (worker.graphile.org/docs/performance):
// concurrentJobs 24, maxPoolSize 25, localQueue.size 500, completeJobBatchDelay 0,
// failJobBatchDelay 0; the benchmark may override the concurrency and local queue (the sweep).
function workerOptions(a) {
  if (a.config === "default") {
    return a.concurrency > 0 ? { concurrentJobs: a.concurrency } : {};
  }
  const concurrentJobs = a.concurrency > 0 ? a.concurrency : 24;
  return {
    concurrentJobs,
    maxPoolSize: concurrentJobs + 1,
    localQueue: { size: a.localQueue > 0 ? a.localQueue : 500 },
    completeJobBatchDelay: 0,
    failJobBatchDelay: 0,
  };
}

// nowNanos is the wall clock in nanoseconds with sub-millisecond resolution (Date.now() has 1 ms).
function nowNanos() {
  return BigInt(Math.round((performance.timeOrigin + performance.now()) * 1e3)) * 1000n;
}

async function startRunner(a, stamps) {
  const opts = workerOptions(a);
  const pool = new pg.Pool({ ...pgConfig(a.dsn), max: opts.maxPoolSize ?? 10 });
  const logger = new Logger(() => (level, message) => {
    if (level === "error" || level === "warning") process.stderr.write(`graphile ${level}: ${message}\n`);
  });
  const taskList = {
    noop: async (payload, helpers) => {
      if (payload.stage === 1 && stamps) {
        const k = String(payload.msg);
        if (!stamps.has(k)) stamps.set(k, nowNanos());
      }
      if (payload.stage < payload.last) {
        await helpers.addJob("noop", { msg: payload.msg, stage: payload.stage + 1, last: payload.last });
      }
    },
  };
  const runner = await run({
    pgPool: pool,
    taskList,
    noHandleSignals: true,
    logger,
    preset: { worker: { ...opts, logger } },
  });
  return { runner, pool };
}

async function stopRunner(r) {
  await r.runner.stop();
  await r.pool.end();
}

function writeStamps(path, stamps) {
  let s = "";
  for (const [k, v] of stamps) s += `${k} ${v}\n`;
  writeFileSync(path, s);
}

function onSignal(fn) {
  let done = false;
  for (const sig of ["SIGTERM", "SIGINT"]) {
    process.on(sig, () => {
      if (done) return;
      done = true;
      fn().then(
        () => process.exit(0),
        (e) => {
          process.stderr.write(`run.mjs: stop: ${e?.stack ?? e}\n`);
          process.exit(1);
        },
      );
    });
  }
}

async function main() {
  if (args.cmd === "migrate") {
    const pool = new pg.Pool(pgConfig(args.dsn));
    await runMigrations({ pgPool: pool, logger: undefined });
    await pool.end();
    return;
  }
  if (args.cmd !== "run") throw new Error(`run.mjs: unknown command ${args.cmd}`);

  if (args.child !== undefined || args.processes <= 1) {
    // One runner in this process.
    const stamps = args.stamp ? new Map() : null;
    const r = await startRunner(args, stamps);
    onSignal(async () => {
      await stopRunner(r);
      if (stamps) writeStamps(args.stamp, stamps);
    });
    if (process.send) process.send("ready");
    else process.stdout.write("ready\n");
    return;
  }

  // N child processes, each a runner; this process only starts and stops them.
  const self = fileURLToPath(import.meta.url);
  const children = [];
  const readies = [];
  for (let i = 0; i < args.processes; i++) {
    const cargs = ["run", "-dsn", args.dsn, "-config", args.config, "-concurrency", String(args.concurrency),
      "-local-queue", String(args.localQueue), "-child"];
    if (args.stamp) cargs.push("-stamp", `${args.stamp}.${i}`);
    const c = fork(self, cargs, { stdio: ["ignore", "inherit", "inherit", "ipc"] });
    children.push(c);
    readies.push(new Promise((resolve, reject) => {
      c.once("message", (m) => (m === "ready" ? resolve() : reject(new Error(`child ${i}: ${m}`))));
      c.once("exit", (code) => reject(new Error(`child ${i} exited with ${code} before it was ready`)));
    }));
  }
  const exits = children.map((c) => new Promise((resolve) => {
    if (c.exitCode !== null) resolve(c.exitCode);
    else c.once("exit", (code) => resolve(code));
  }));
  onSignal(async () => {
    for (const c of children) c.kill("SIGTERM");
    const codes = await Promise.all(exits);
    if (args.stamp) {
      let all = "";
      for (let i = 0; i < children.length; i++) {
        const f = `${args.stamp}.${i}`;
        if (existsSync(f)) {
          all += readFileSync(f, "utf8");
          unlinkSync(f);
        }
      }
      writeFileSync(args.stamp, all);
    }
    if (codes.some((c) => c !== 0)) throw new Error(`child exit codes ${codes.join(", ")}`);
  });
  await Promise.all(readies);
  process.stdout.write("ready\n");
}

main().catch((e) => {
  process.stderr.write(`run.mjs: ${e?.stack ?? e}\n`);
  process.exit(1);
});
