//! The trainer on the real model (SmolLM2): overfitting a fixed batch, checkpoint → `nextstate loss` and
//! `nextstate serve` see the weights the trainer saw, and kill -9 / `--resume` against the real broker
//! consumes every sample exactly once.
use crate::common;

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nextstate::config::PipelineConfig;
use nextstate::method::Method;
use nextstate::model::{LanguageModel, LoadOptions, Trainable};
use nextstate::schema::{content_hash, Message, Sample, SampleType};
use nextstate::trainer::{CheckpointWriter, Trainer, TrainerConfig};

/// Short chat samples: prompt = a question rendered with the chat template; response = a fixed answer
/// with the end-of-turn token; rollout log-probs scored under the initial weights.
fn samples(lm: &LanguageModel, n: usize, pipeline: &str) -> Vec<Sample> {
    let mut out = vec![];
    for i in 0..n {
        let msgs = vec![Message::text("user", format!("What is {i} plus {i}? Answer briefly."))];
        let prompt = lm.chat_prompt_ids(&msgs, None, true).unwrap();
        let mut response = lm.encode(&format!("{i} plus {i} is {}.", 2 * i)).unwrap();
        response.push(lm.eos_token_ids()[0]);
        let rollout = lm.score(&[(prompt.clone(), response.clone())], 0).unwrap().remove(0).logprobs;
        let id = content_hash(&[pipeline.as_bytes(), &(i as u64).to_le_bytes()]);
        out.push(Sample {
            sample_id: id.clone(),
            pipeline: pipeline.into(),
            interaction_id: format!("i-{id}"),
            session_id: format!("s{i}"),
            rollout_logprobs_recomputed: true,
            event_time: 1_764_000_000_000 + i as i64,
            ..Sample::new(
                SampleType::Binary,
                prompt.iter().map(|&x| x as i32).collect(),
                response.iter().map(|&x| x as i32).collect(),
                rollout,
                if i % 2 == 0 { 1.0 } else { -1.0 },
            )
        });
    }
    out
}

fn items(s: &[Sample]) -> Vec<(Vec<u32>, Vec<u32>)> {
    s.iter()
        .map(|s| (s.prompt_token_ids.iter().map(|&x| x as u32).collect(), s.response_token_ids.iter().map(|&x| x as u32).collect()))
        .collect()
}

fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter().zip(b).flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs())).fold(0.0, f32::max)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overfits_a_fixed_batch_and_the_checkpoint_serves_the_trained_weights() {
    let Some(model) = common::smollm2() else {
        common::missing("models/smollm2-135m-instruct missing (run scripts/setup.sh)");
        return;
    };
    let _ = nextstate::model::set_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let lm = LanguageModel::load(&model, &LoadOptions { trainable: Trainable::Full, ..Default::default() }).unwrap();
    let batch = samples(&lm, 4, "overfit");
    let cfg = TrainerConfig { batch_size: 4, lr: 1e-5, checkpoint_every: 20, ..Default::default() };
    let mut trainer = Trainer::new(lm, Method::Binary, cfg.clone(), CheckpointWriter::new(dir.path(), "overfit")).unwrap();
    let mut losses = vec![];
    let mut checkpoint = None;
    for _ in 0..20 {
        let out = trainer.train_step(&batch).unwrap();
        losses.push(out.train_step.unwrap().loss);
        if let Some(c) = out.checkpoint {
            checkpoint = Some(c);
        }
    }
    eprintln!("losses: {losses:?}");
    // PPO on a fixed batch with fixed rollout log-probs: the surrogate (the mean over the 4 samples) falls
    // until the ratios reach the clip range (−(1/4) Σ clip(ratio)·A over 2 positive and 2 negative
    // samples → at least −(2·1.28 − 2·0.8)/4 = −0.24).
    assert!(losses[19] < losses[0] - 0.0125, "loss did not decrease: {losses:?}");
    assert!(losses[19] >= -0.24 - 1e-6, "{losses:?}");
    let first: f64 = losses[..5].iter().sum::<f64>() / 5.0;
    let last: f64 = losses[15..].iter().sum::<f64>() / 5.0;
    assert!(last < first, "{losses:?}");
    let ck = checkpoint.expect("a checkpoint at step 20");
    assert_eq!(ck.row.version, 1);
    assert_eq!(ck.manifest.lineage.len(), 80, "20 steps × 4 samples in the lineage");

    // What the trainer sees now, per token.
    let seen: Vec<Vec<f32>> = trainer.policy().score(&items(&batch), 0).unwrap().into_iter().map(|s| s.logprobs).collect();
    // `nextstate loss` on the checkpoint folder.
    let mut pcfg = PipelineConfig::embedded_default();
    pcfg.method = Method::Binary;
    pcfg.policy.model = model.clone();
    pcfg.trainer = cfg;
    let report = nextstate::stages::train::loss_command(&pcfg, Some(&ck.path), &batch).unwrap();
    let d = max_abs_diff(&seen, &report.token_logprobs);
    eprintln!("loss command vs trainer: max |Δ log-prob| = {d:e}");
    assert!(d < 1e-5, "loss command vs trainer: {d}");
    assert_eq!(report.report.version, 1);
    // Its pg_loss is the mean over the samples of each sample's token mean of the PPO-clipped surrogate
    // (docs/method.md §6), recomputed here from its own per-token log-probs, the rollout log-probs and the
    // rewards (the binary advantage).
    let (lo, hi) = (1.0 - pcfg.trainer.eps_clip, 1.0 + pcfg.trainer.eps_clip_high);
    let sample_means: Vec<f64> = batch
        .iter()
        .zip(&report.token_logprobs)
        .map(|(s, new)| {
            let a = s.reward as f64;
            let pg: f64 = new.iter().zip(&s.rollout_logprobs).map(|(&n, &o)| {
                let ratio = (n as f64 - o as f64).exp();
                (-a * ratio).max(-a * ratio.clamp(lo, hi))
            }).sum();
            pg / new.len() as f64
        })
        .collect();
    let expected = sample_means.iter().sum::<f64>() / sample_means.len() as f64;
    let got = report.report.batches[0].pg_loss;
    eprintln!("loss command pg_loss {got} vs mean of sample means {expected}");
    assert!((got - expected).abs() < 1e-6, "pg_loss {got} vs mean of sample means {expected}");

    // `nextstate serve`: start on the initial weights, reload the checkpoint, score the greedy answer.
    let (url, handle) = start_server(&model).await;
    handle.reload(ck.path.clone(), 1).await.unwrap();
    let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "What is 1 plus 1? Answer briefly."}],
        "max_tokens": 12, "temperature": 0.0, "logprobs": true});
    let v: serde_json::Value = nextstate::net::http_client(None).unwrap().post(format!("{url}/v1/chat/completions")).json(&body).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["policy_version"], 1);
    let prompt: Vec<u32> = v["prompt_token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    let toks: Vec<u32> = v["choices"][0]["token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    let served: Vec<f32> = v["choices"][0]["logprobs"]["content"].as_array().unwrap().iter().map(|c| c["logprob"].as_f64().unwrap() as f32).collect();
    let trained = trainer.policy().score(&[(prompt, toks)], 0).unwrap().remove(0).logprobs;
    let d = max_abs_diff(&[served], &[trained]);
    eprintln!("server (KV-cache decoding) vs trainer: max |Δ log-prob| = {d:e}");
    assert!(d < 1e-5, "server vs trainer: {d}");
}

/// A policy server on `model` (the shared policy, version 0; raw log-probs, batches of 4), serving until
/// the test ends: (URL, handle).
async fn start_server(model: &std::path::Path) -> (String, nextstate::serve::PolicyHandle) {
    let opts = nextstate::serve::ServerOptions {
        model_name: "m".into(),
        api_key: None,
        health_requires_key: false,
        limits: Default::default(),
        max_body_bytes: 1 << 20,
        max_batch: 4,
        batch_window: Duration::from_millis(5),
        default_max_tokens: 16,
        logprobs_mode: nextstate::model::LogprobMode::Raw,
        load: LoadOptions::default(),
        base_dir: model.to_path_buf(),
        threads: 0,
        merge_lora: false,
        continuous_batching: true,
    };
    let server = nextstate::serve::PolicyServer::start(LanguageModel::load(model, &LoadOptions::default()).unwrap(), 0, opts).unwrap();
    let handle = server.handle();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(server.serve(listener, std::future::pending()));
    (url, handle)
}

/// Publishes `samples` into the `samples` topic of the broker at `brokers` (topics created with
/// `partitions` partitions under `prefix`) and flushes.
async fn publish_samples(brokers: &str, prefix: &str, partitions: i32, samples: &[Sample]) {
    let bus = nextstate::bus::Bus::connect(nextstate::bus::BusConfig { brokers: Some(brokers.to_string()), topic_prefix: prefix.to_string(), partitions, ..Default::default() })
        .await
        .unwrap();
    bus.ensure_topics(&["samples", "train_steps", "checkpoints", "dead_letters"]).await.unwrap();
    let p = bus.producer().unwrap();
    for s in samples {
        p.send(s, None).await.unwrap();
    }
    p.flush().unwrap();
}

fn write_pipeline(path: &std::path::Path, name: &str, model: &std::path::Path) {
    std::fs::write(
        path,
        format!(
            "name = \"{name}\"\nmethod = \"binary\"\n[bus]\npartitions = 2\nmax_poll_interval_ms = 10000\n[policy]\nmodel = \"{}\"\nthreads = 1\n\
             [trainer]\nbatch_size = 2\ncheckpoint_every = 1\nlr = 1e-4\n[trainer.lora]\nenabled = true\nrank = 4\nalpha = 8\n",
            model.display()
        ),
    )
    .unwrap();
}

fn spawn_train(pipeline: &std::path::Path, brokers: &str, prefix: &str, lake: &std::path::Path, ck: &std::path::Path, extra: &[&str], log: &std::path::Path) -> std::process::Child {
    let log = std::fs::File::create(log).unwrap();
    Command::new(common::bin())
        .args(["train", "--pipeline"])
        .arg(pipeline)
        .args(["--brokers", brokers, "--topic-prefix", prefix, "--lake"])
        .arg(lake)
        .arg("--checkpoints")
        .arg(ck)
        .args(["--group-instance-id", "trainer-1"])
        .args(extra)
        .env("OMP_NUM_THREADS", "1")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_trainer_resumes_and_consumes_every_sample_exactly_once() {
    let Some(model) = common::smollm2() else {
        common::missing("models/smollm2-135m-instruct missing (run scripts/setup.sh)");
        return;
    };
    const N: usize = 12;
    let brokers = common::brokers();
    let prefix = common::prefix();
    let dir = tempfile::tempdir().unwrap();
    let (lake, ck, pfile) = (dir.path().join("lake"), dir.path().join("ck"), dir.path().join("p.toml"));
    write_pipeline(&pfile, "resume", &model);
    let lm = LanguageModel::load(&model, &LoadOptions::default()).unwrap();
    let all = samples(&lm, N, "resume");
    drop(lm);
    publish_samples(&brokers, &prefix, 2, &all).await;

    // First run: killed with SIGKILL once two checkpoints exist (between later checkpoints).
    let mut child = spawn_train(&pfile, &brokers, &prefix, &lake, &ck, &[], &dir.path().join("train-1.log"));
    let run_dir = ck.join("resume");
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let v = nextstate::trainer::latest_complete(&run_dir).unwrap().map(|(_, m)| m.version).unwrap_or(0);
        if v >= 2 || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let before = nextstate::trainer::scan(&run_dir).unwrap().complete.len();
    assert!(before >= 2, "two checkpoints before the kill");
    assert!(before < N / 2, "killed before the end ({before} checkpoints)");

    // Resume: starts from the newest checkpoint, skips what it consumed, trains the rest.
    let log2 = dir.path().join("train-2.log");
    let mut child = spawn_train(&pfile, &brokers, &prefix, &lake, &ck, &["--resume", "--until-idle"], &log2);
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap()).await.unwrap();
    assert!(status.success(), "the resumed trainer failed ({status}):\n{}", std::fs::read_to_string(&log2).unwrap_or_default());
    let scan = nextstate::trainer::scan(&run_dir).unwrap();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (_, m) in &scan.complete {
        for l in &m.lineage {
            *seen.entry(l.sample_id.clone()).or_default() += 1;
            assert_eq!(l.sample_topic.as_deref(), Some(format!("{prefix}samples").as_str()), "lineage names the samples topic");
        }
    }
    assert_eq!(seen.len(), N, "every sample consumed: {seen:?}");
    assert!(seen.values().all(|&c| c == 1), "no sample consumed twice: {seen:?}");
    let versions: Vec<i64> = scan.complete.iter().map(|(_, m)| m.version).collect();
    assert_eq!(versions, (1..=versions.len() as i64).collect::<Vec<_>>(), "one unbroken lineage of versions");
    for w in scan.complete.windows(2) {
        assert_eq!(w[1].1.parent_version, w[0].1.version);
    }
}

/// `∂loss/∂θ` of every trainable tensor of `lm`, by name (zero where no gradient flowed).
fn gradients(lm: &LanguageModel) -> Vec<(String, tch::Tensor)> {
    let mut v: Vec<(String, tch::Tensor)> = lm
        .transformer()
        .var_store()
        .variables()
        .into_iter()
        .filter(|(_, t)| t.requires_grad())
        .map(|(n, t)| {
            let g = t.grad();
            (n, if g.defined() { g.copy() } else { t.zeros_like() })
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn zero_grad(lm: &LanguageModel) {
    for (_, t) in lm.transformer().var_store().variables() {
        let mut g = t.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
}

/// The largest |a − b| over all tensors, relative to the largest |a|.
fn rel_diff(a: &[(String, tch::Tensor)], b: &[(String, tch::Tensor)]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().map(|(_, t)| t.abs().max().double_value(&[])).fold(0.0, f64::max);
    assert!(scale > 0.0, "no gradient at all");
    a.iter().zip(b).map(|((na, x), (nb, y))| {
        assert_eq!(na, nb);
        (x - y).abs().max().double_value(&[])
    }).fold(0.0, f64::max) / scale
}

/// Gradients of the trainer's path (`accumulate_gradients`: output head in chunks of positions,
/// micro-batches, optional per-layer recomputation) against plain autograd through the whole model and
/// the whole `[B, T, V]` log-softmax, on SmolLM2 with LoRA and with full fine-tuning (tied embeddings).
/// The weights are cast to f64: in f32 the paths round differently (head matmuls over 7 rows instead of
/// all, micro-batches padded to other lengths, each layer's forward run a second time), which measured
/// 2e-5–2e-4 relative on the largest gradient; in f64 rounding is ~1e-16 and an error in the path would
/// show at O(1). Measured in f64: 4.8e-16 (LoRA) and 3.6e-16 (full). Both paths still take the
/// output head's log-softmax and the loss in f32 (`Kind::Float` in `response_logprobs` and `evaluate`):
/// they agree to 1e-16 only because their f64 logits (1e-15 apart) round to the same f32s, so the inputs
/// must be the same in every process (see the LoRA B initialisation below).
#[test]
fn chunked_and_recomputed_gradients_equal_the_unchunked_loss_on_smollm2() {
    use nextstate::trainer::{accumulate_gradients, loss, pack_samples, PackOptions};
    let Some(model) = common::smollm2() else {
        panic!("models/smollm2-135m-instruct is missing: run scripts/setup.sh");
    };
    tch::set_num_threads(2);
    let mut results = vec![];
    for (trainable, double, recompute) in [("lora", true, false), ("lora", true, true), ("full", true, true)] {
        // Loaded in f64 (not cast afterwards: a LoRA model's frozen base is shared with the process's
        // other models of the same files and kind, and must never be changed in place).
        let dtype = if double { tch::Kind::Double } else { tch::Kind::Float };
        let opts = match trainable {
            "lora" => LoadOptions { dtype, trainable: Trainable::Lora(nextstate::model::LoraConfig { rank: 4, alpha: 8.0, targets: nextstate::model::LoraTarget::ALL.to_vec() }), ..Default::default() },
            _ => LoadOptions { dtype, trainable: Trainable::Full, ..Default::default() },
        };
        tch::manual_seed(5);
        let lm = LanguageModel::load(&model, &opts).unwrap();
        let mut s = samples(&lm, 2, "grad");
        tch::no_grad(|| {
            // LoRA B starts at zero, so A would get no gradient: give B a value so both are tested. In
            // name order: `variables()` is a HashMap, whose order differs per process, so drawing in its
            // order gave every process other B weights (the seed fixes the draws, not which tensor gets
            // which) and another gradient difference: one CI run measured 3.96e-8 for LoRA (likely a
            // logit whose f64 values in the two paths round to different f32s, see above).
            let mut vars: Vec<_> = lm.transformer().var_store().variables().into_iter().filter(|(n, _)| n.contains("lora_B")).collect();
            vars.sort_by(|a, b| a.0.cmp(&b.0));
            for (_, mut t) in vars {
                let _ = t.copy_(&(tch::Tensor::randn(t.size(), (tch::Kind::Float, tch::Device::Cpu)) * 0.01));
            }
        });
        // Combined with a hint and score-only, rollout shifted off-policy so some ratios clip.
        for (i, x) in s.iter_mut().enumerate() {
            x.sample_type = if i == 1 { SampleType::CombinedScoreOnly } else { SampleType::CombinedBoth };
            for (j, lp) in x.rollout_logprobs.iter_mut().enumerate() {
                *lp += 0.25 * ((i + j) % 3) as f32 - 0.25;
            }
            x.teacher_logprobs = Some(if i == 1 { x.rollout_logprobs.clone() } else { x.rollout_logprobs.iter().enumerate().map(|(j, v)| v + 0.5 - 0.1 * j as f32).collect() });
        }
        let cfg = TrainerConfig { entropy_coef: 0.01, ..TrainerConfig::default() };
        let lcfg = cfg.loss_config(Method::Combined);

        // Reference: autograd through the whole model and the whole [B, T, V] log-softmax, one loss.
        let pack = PackOptions { method: Method::Combined, vocab_size: 49_152, pad_id: lm.pad_token_id() as i64, current_version: 0, device: tch::Device::Cpu, config: cfg.clone() };
        let b = pack_samples(&s, &pack).unwrap().batch.unwrap();
        let mb = nextstate::model::PackedBatch {
            input_ids: b.input_ids.shallow_clone(),
            response_ids: b.response_ids.shallow_clone(),
            response_mask: b.response_mask.shallow_clone(),
            predict_positions: b.predict_positions.shallow_clone(),
            prompt_lens: b.prompt_lens.clone(),
            response_lens: b.response_lens.clone(),
        };
        let rl = lm.response_logprobs(&mb).unwrap();
        let ent = loss::entropy(&rl.log_probs_full).unwrap();
        let inputs = loss::LossInputs {
            new_logprobs: &rl.logprobs,
            old_logprobs: &b.old_logprobs,
            teacher_logprobs: b.teacher_logprobs.as_ref(),
            reward: &b.reward,
            mask: &b.loss_mask,
            sample_types: &b.sample_types,
            sample_weights: Some(&b.sample_weight),
            advantage_signs: Some(&b.advantage_sign),
            ref_logprobs: None,
            entropy: Some(&ent),
            topk: None,
            sample_tokens: None,
            num_samples: None,
        };
        let want = loss::compute_loss(&lcfg, &inputs).unwrap();
        want.loss.backward();
        let want_grads = gradients(&lm);
        zero_grad(&lm);

        // Head chunks of 7 rows (3 positions of 2 samples), one sample per micro-batch (40 tokens).
        let c = TrainerConfig { recompute_layers: recompute, logits_chunk_tokens: 7, micro_batch_tokens: 40, ..cfg.clone() };
        let acc = accumulate_gradients(&lm, None, Method::Combined, &c, 0, &s).unwrap();
        let m = acc.metrics.unwrap();
        let d = rel_diff(&want_grads, &gradients(&lm));
        eprintln!("{trainable} f64={double} recompute={recompute}: loss {:.9} (reference {:.9}), gradient max relative difference {d:.2e}", m.loss, want.metrics.loss);
        assert!((m.loss - want.metrics.loss).abs() < 1e-6, "{trainable}: loss {} vs {}", m.loss, want.metrics.loss);
        results.push((trainable, double, recompute, d));
    }
    assert!(results.iter().all(|r| r.3 <= 1e-9), "{results:?}");
}

/// What a one-partition `nextstate train` test needs: the model, the broker, a fresh topic prefix, a
/// temporary folder with the lake, checkpoints and pipeline file (written).
struct Run {
    model: std::path::PathBuf,
    brokers: String,
    prefix: String,
    dir: tempfile::TempDir,
    lake: std::path::PathBuf,
    ck: std::path::PathBuf,
    pfile: std::path::PathBuf,
}

/// [`Run`] for pipeline `name` with `method` ([`write_one_partition_pipeline`]); `None` (reported as
/// missing) without the model.
fn one_partition_run(name: &str, method: &str) -> Option<Run> {
    let Some(model) = common::smollm2() else {
        common::missing("models/smollm2-135m-instruct missing (run scripts/setup.sh)");
        return None;
    };
    let dir = tempfile::tempdir().unwrap();
    let (lake, ck, pfile) = (dir.path().join("lake"), dir.path().join("ck"), dir.path().join("p.toml"));
    write_one_partition_pipeline(&pfile, name, method, &model);
    Some(Run { model, brokers: common::brokers(), prefix: common::prefix(), dir, lake, ck, pfile })
}

/// A pipeline file for `nextstate train` with `method` on one partition: batches of 2, a checkpoint per
/// step, LoRA rank 4.
fn write_one_partition_pipeline(path: &std::path::Path, name: &str, method: &str, model: &std::path::Path) {
    std::fs::write(
        path,
        format!(
            "name = \"{name}\"\nmethod = \"{method}\"\n[bus]\npartitions = 1\nmax_poll_interval_ms = 10000\n[policy]\nmodel = \"{}\"\nthreads = 1\n\
             [trainer]\nbatch_size = 2\ncheckpoint_every = 1\nlr = 1e-4\n[trainer.lora]\nenabled = true\nrank = 4\nalpha = 8\n",
            model.display()
        ),
    )
    .unwrap();
}

/// Runs `nextstate train --until-idle` (plus `extra`) to the end and returns its output.
fn train_until_idle(pfile: &std::path::Path, brokers: &str, prefix: &str, lake: &std::path::Path, ck: &std::path::Path, extra: &[&str]) -> std::process::Output {
    Command::new(common::bin())
        .args(["train", "--pipeline"])
        .arg(pfile)
        .args(["--brokers", brokers, "--topic-prefix", prefix, "--lake"])
        .arg(lake)
        .arg("--checkpoints")
        .arg(ck)
        .args(["--group-instance-id", "trainer-1", "--until-idle"])
        .args(extra)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap()
}

/// A sample whose teacher log-probs are `f32::MIN` (−3.4028235e38: what a teacher server that writes
/// `torch.finfo(torch.float32).min` for log 0 sends — finite, so packing keeps it) makes the loss +inf.
/// Published between good samples, it must be dead-lettered exactly once (stage `train`,
/// `non_finite_loss`), the step retried without it, every good sample trained exactly once, and the run
/// must end normally with its checkpoints. A last batch holding only a poisoned sample is skipped whole
/// (no step, no checkpoint after it), yet its offset is committed: a resumed run finds nothing left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poisoned_sample_is_dead_lettered_once_and_training_goes_on() {
    let Some(Run { model, brokers, prefix, dir, lake, ck, pfile }) = one_partition_run("poison", "opd") else {
        return;
    };
    let lm = LanguageModel::load(&model, &LoadOptions::default()).unwrap();
    let mut all = samples(&lm, 5, "poison");
    drop(lm);
    const POISON: [usize; 2] = [2, 4];
    for (i, s) in all.iter_mut().enumerate() {
        s.sample_type = SampleType::Opd;
        s.reward = 0.0;
        s.teacher_logprobs = Some(if POISON.contains(&i) { vec![f32::MIN; s.len()] } else { s.rollout_logprobs.iter().map(|x| x + 0.05).collect() });
    }
    publish_samples(&brokers, &prefix, 1, &all).await;

    let run = |extra: &[&str], n: u32| {
        let out = train_until_idle(&pfile, &brokers, &prefix, &lake, &ck, extra);
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
        assert!(out.status.success(), "trainer run {n} failed ({}):\n{stdout}\n{stderr}", out.status);
        stdout
    };
    // Batches of 2 in topic order: [s0, s1] → step 1; [s2 (poisoned), s3] → s2 skipped, step 2 on s3;
    // [s4 (poisoned)] → skipped whole.
    let started = Instant::now();
    let jsonl = dir.path().join("metrics/steps.jsonl");
    let out = tokio::task::block_in_place(|| run(&["--metrics-jsonl", jsonl.to_str().unwrap()], 1));
    eprintln!("first run: {:.1} s\n{out}", started.elapsed().as_secs_f64());
    assert!(out.contains("train: steps=2 samples_trained=3 "), "{out}");
    assert!(out.contains("skipped_steps=1 skipped_samples={\"non_finite_loss\": 2}"), "{out}");
    // --metrics-jsonl: one parseable line per train_steps row, equal to the lake's rows.
    let lines: Vec<nextstate::schema::TrainStep> = std::fs::read_to_string(&jsonl).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let mut rows: Vec<nextstate::schema::TrainStep> = nextstate::lake::Lake::open(&lake).unwrap().read_table().unwrap();
    rows.sort_by_key(|r| r.step);
    assert_eq!(lines, rows);
    assert_eq!(lines.iter().map(|r| r.step).collect::<Vec<_>>(), vec![1, 2]);
    // OPD with teacher = rollout + 0.05 and A = teacher − current policy (docs/method.md §6): at step 1 the
    // current policy is the one that sampled, so every trained token has A > 0; at step 2 the policy has
    // moved, so the signs are whatever the move made them. Every sample has r = 0.
    assert_eq!((lines[0].positive_advantage_fraction, lines[0].negative_advantage_fraction), (Some(1.0), Some(0.0)), "{:?}", lines[0]);
    // The advantage is the teacher's alone (OPD: no reward part), +0.05 on every token at step 1.
    assert_eq!((lines[0].advantage_reward_abs_mean, lines[0].teacher_term_positive_fraction, lines[0].teacher_term_negative_fraction), (Some(0.0), Some(1.0), Some(0.0)), "{:?}", lines[0]);
    assert!(lines[0].advantage_teacher_abs_mean.is_some_and(|t| (t - 0.05).abs() < 1e-3), "{:?}", lines[0]);
    for r in &lines {
        assert_eq!((r.reward_mean, r.reward_std, r.learning_rate), (Some(0.0), Some(0.0), Some(1e-4)), "{r:?}");
        assert!(r.positive_advantage_fraction.unwrap() + r.negative_advantage_fraction.unwrap() <= 1.0 + 1e-12, "{r:?}");
        assert!(r.response_length_max.is_some_and(|m| m > 0) && r.tokens_per_second.is_some_and(|x| x > 0.0), "{r:?}");
    }

    let run_dir = ck.join("poison");
    let scan = nextstate::trainer::scan(&run_dir).unwrap();
    assert_eq!(scan.complete.iter().map(|(_, m)| m.version).collect::<Vec<_>>(), vec![1, 2], "one checkpoint per step");
    let mut seen: HashMap<String, Vec<(bool, Option<String>)>> = HashMap::new();
    for (_, m) in &scan.complete {
        for l in &m.lineage {
            seen.entry(l.sample_id.clone()).or_default().push((l.trained, l.drop_reason.clone()));
        }
    }
    // s4's skip took no step, so no checkpoint followed it: it is in the dead letters only.
    assert_eq!(seen.len(), 4, "{seen:?}");
    for (i, s) in all[..4].iter().enumerate() {
        let want = if i == 2 { vec![(false, Some("non_finite_loss".to_string()))] } else { vec![(true, None)] };
        assert_eq!(seen[&s.sample_id], want, "sample {i}");
    }
    let m2 = &scan.complete[1].1;
    assert_eq!((m2.step, m2.metrics.len(), m2.metrics[0].metrics.samples), (2, 1, 1), "step 2 trained s3 alone");

    let dead: Vec<nextstate::schema::DeadLetter> = nextstate::lake::Lake::open(&lake).unwrap().read_table().unwrap();
    let train_dead: Vec<_> = dead.iter().filter(|d| d.stage == "train").collect();
    assert_eq!(train_dead.len(), 2, "{dead:?}");
    for i in POISON {
        let d = train_dead.iter().find(|d| d.input_key.as_deref() == Some(all[i].interaction_id.as_str())).unwrap_or_else(|| panic!("s{i} dead-lettered: {train_dead:?}"));
        assert_eq!(d.reason_code, "non_finite_loss");
        assert!(d.reason.contains(&format!("sample {} not trained", all[i].sample_id)) && d.reason.contains("loss is inf"), "{}", d.reason);
    }

    // Offsets were committed past everything: a resumed run trains and dead-letters nothing more.
    let out = tokio::task::block_in_place(|| run(&["--resume"], 2));
    assert!(out.contains("train: steps=0 samples_trained=0 "), "{out}");
    assert!(out.contains("skipped_steps=0 skipped_samples={}"), "{out}");
    let dead: Vec<nextstate::schema::DeadLetter> = nextstate::lake::Lake::open(&lake).unwrap().read_table().unwrap();
    assert_eq!(dead.iter().filter(|d| d.stage == "train").count(), 2);
    assert_eq!(nextstate::trainer::scan(&run_dir).unwrap().complete.len(), 2);
}

/// The trainer guards itself on the real broker (`trainer.quarantine`, on by default): a truncated, an
/// empty, a one-token and a high-gap sample (rollout log-probs 3 nats per token below the weights')
/// published between good ones are each dead-lettered once with their reason and enter the lineage
/// untrained; every good sample is trained exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_empty_near_empty_and_high_gap_samples_are_quarantined_once() {
    let Some(Run { model, brokers, prefix, dir: _dir, lake, ck, pfile }) = one_partition_run("guard", "binary") else {
        return;
    };
    let lm = LanguageModel::load(&model, &LoadOptions::default()).unwrap();
    let mut all = samples(&lm, 8, "guard");
    drop(lm);
    all[1].truncated = Some(true);
    let s = &mut all[3];
    (s.response_token_ids, s.loss_mask, s.rollout_logprobs) = (vec![], vec![], vec![]);
    let s = &mut all[5];
    (s.response_token_ids, s.loss_mask, s.rollout_logprobs) = (s.response_token_ids[..1].to_vec(), vec![1], s.rollout_logprobs[..1].to_vec());
    for x in &mut all[6].rollout_logprobs {
        *x -= 3.0;
    }
    let bad: [(usize, &str); 4] = [(1, "truncated"), (3, "empty_response"), (5, "near_empty_response"), (6, "logprob_gap")];
    publish_samples(&brokers, &prefix, 1, &all).await;

    let out = train_until_idle(&pfile, &brokers, &prefix, &lake, &ck, &[]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "trainer failed ({}):\n{stdout}\n{stderr}", out.status);
    // Batches of 2 in topic order: [g0, truncated], [g2, empty], [g4, one token], [high gap, g7]: four
    // steps of one good sample each (the last retried without the high-gap sample).
    assert!(stdout.contains("train: steps=4 samples_trained=4 "), "{stdout}");
    assert!(stdout.contains("dropped={\"empty_response\": 1, \"logprob_gap\": 1, \"near_empty_response\": 1, \"truncated\": 1} skipped_steps=0"), "{stdout}");
    assert!(stderr.contains("samples quarantined for their log-prob gap"), "{stderr}");

    let scan = nextstate::trainer::scan(&ck.join("guard")).unwrap();
    assert_eq!(scan.complete.iter().map(|(_, m)| m.version).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
    let mut seen: HashMap<String, Vec<(bool, Option<String>)>> = HashMap::new();
    for (_, m) in &scan.complete {
        assert_eq!(m.metrics.iter().map(|r| r.metrics.samples).collect::<Vec<_>>(), vec![1], "one good sample per step");
        for l in &m.lineage {
            seen.entry(l.sample_id.clone()).or_default().push((l.trained, l.drop_reason.clone()));
        }
    }
    assert_eq!(seen.len(), 8, "{seen:?}");
    for (i, s) in all.iter().enumerate() {
        let want = match bad.iter().find(|(j, _)| *j == i) {
            Some((_, r)) => vec![(false, Some(r.to_string()))],
            None => vec![(true, None)],
        };
        assert_eq!(seen[&s.sample_id], want, "sample {i}");
    }
    let dead: Vec<nextstate::schema::DeadLetter> = nextstate::lake::Lake::open(&lake).unwrap().read_table().unwrap();
    let train_dead: Vec<_> = dead.iter().filter(|d| d.stage == "train").collect();
    assert_eq!(train_dead.len(), 4, "{train_dead:?}");
    for (i, reason) in bad {
        let d: Vec<_> = train_dead.iter().filter(|d| d.input_key.as_deref() == Some(all[i].interaction_id.as_str())).collect();
        assert_eq!(d.len(), 1, "sample {i} dead-lettered once: {train_dead:?}");
        assert_eq!(d[0].reason_code, reason);
        assert!(d[0].reason.contains(&format!("sample {} dropped", all[i].sample_id)), "{}", d[0].reason);
    }
}

/// The OPD target of `nextstate loss --json`, checked independently (docs/method.md §6, the reference's
/// openclaw-combine/combine_loss.py): on samples whose teacher and rollout log-probs are perturbed
/// token by token, every reported token advantage equals the teacher log-prob minus the policy's own
/// log-prob of the token, the latter computed here with the inference scorer (`LanguageModel::score`,
/// not the trainer's forward pass) — to 1e-5 — and the rollout log-probs never enter it (a second
/// perturbation of them changes no advantage). Score-only combined samples have advantage r exactly.
#[test]
fn loss_json_reports_teacher_minus_the_current_policy() {
    use rand::{Rng, SeedableRng};
    let Some(model) = common::smollm2() else {
        common::missing("models/smollm2-135m-instruct missing (run scripts/setup.sh)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let pfile = dir.path().join("p.toml");
    std::fs::write(&pfile, format!("name = \"losscheck\"\nmethod = \"combined\"\n[policy]\nmodel = \"{}\"\nthreads = 1\n[trainer]\nbatch_size = 4\n", model.display())).unwrap();
    let lm = LanguageModel::load(&model, &LoadOptions::default()).unwrap();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(37);
    let base = samples(&lm, 4, "losscheck");
    let run = |rows: &[Sample], tag: &str| -> serde_json::Value {
        let lake_dir = dir.path().join(tag);
        nextstate::lake::Lake::open(&lake_dir).unwrap().write_rows(rows, "test", 1).unwrap();
        let out = Command::new(common::bin())
            .args(["loss", "--pipeline"])
            .arg(&pfile)
            .args(["--sql", "SELECT * FROM samples ORDER BY sample_id", "--json", "--lake"])
            .arg(&lake_dir)
            .env("OMP_NUM_THREADS", "1")
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let mut perturbed = base.clone();
    for (i, s) in perturbed.iter_mut().enumerate() {
        s.sample_type = if i == 3 { SampleType::CombinedScoreOnly } else { SampleType::CombinedHintOnly };
        s.reward = if i == 3 { -1.0 } else { 0.0 };
        let teacher: Vec<f32> = s.rollout_logprobs.iter().map(|x| x + rng.gen_range(-0.5f32..0.5)).collect();
        s.teacher_logprobs = Some(if i == 3 { s.rollout_logprobs.clone() } else { teacher });
        s.rollout_logprobs = s.rollout_logprobs.iter().map(|x| x + rng.gen_range(-1.0f32..1.0)).collect();
    }
    perturbed.sort_by(|a, b| a.sample_id.cmp(&b.sample_id));
    let mut other_rollout = perturbed.clone();
    for s in &mut other_rollout {
        s.rollout_logprobs = s.rollout_logprobs.iter().map(|x| x - 0.7).collect();
    }
    let (a, b) = (run(&perturbed, "a"), run(&other_rollout, "b"));
    let items: Vec<(Vec<u32>, Vec<u32>)> = perturbed.iter().map(|s| (s.prompt_token_ids.iter().map(|&x| x as u32).collect(), s.response_token_ids.iter().map(|&x| x as u32).collect())).collect();
    let current = lm.score(&items, 0).unwrap();
    let rows = a["report"]["samples"].as_array().unwrap();
    assert_eq!(rows.len(), 4);
    let mut checked = 0;
    for ((s, row), cur) in perturbed.iter().zip(rows).zip(&current) {
        assert_eq!(row["sample_id"], s.sample_id.as_str());
        let adv: Vec<f64> = serde_json::from_value(row["token_advantages"].clone()).unwrap();
        assert_eq!(adv.len(), s.response_token_ids.len());
        for (t, a_t) in adv.iter().enumerate() {
            let want = if s.sample_type == SampleType::CombinedScoreOnly { -1.0 } else { f64::from(s.teacher_logprobs.as_ref().unwrap()[t]) - f64::from(cur.logprobs[t]) };
            assert!((a_t - want).abs() < 1e-5, "{} token {t}: {a_t} vs {want}", s.sample_id);
            checked += 1;
        }
    }
    assert!(checked > 20, "{checked}");
    // Other rollout log-probs: the same advantages (only the PPO ratio sees them: ppo_kl moves by 0.7).
    for (ra, rb) in rows.iter().zip(b["report"]["samples"].as_array().unwrap()) {
        assert_eq!((&ra["sample_id"], &ra["token_advantages"], &ra["student_logprobs"]), (&rb["sample_id"], &rb["token_advantages"], &rb["student_logprobs"]));
        let d = ra["ppo_kl"].as_f64().unwrap() - rb["ppo_kl"].as_f64().unwrap();
        assert!((d - 0.7).abs() < 1e-4, "ppo_kl {} vs {}", ra["ppo_kl"], rb["ppo_kl"]);
    }
}

/// A per-tenant pipeline file for `nextstate train` (`[trainer.tenants] mode = "per_tenant"`): batches of
/// 2, `min_batch`, `max_tenants`, a checkpoint per step, LoRA rank 4, `partitions` partitions.
fn write_per_tenant_pipeline(path: &std::path::Path, name: &str, model: &std::path::Path, partitions: i32, min_batch: usize, max_tenants: usize) {
    std::fs::write(
        path,
        format!(
            "name = \"{name}\"\nmethod = \"binary\"\n[bus]\npartitions = {partitions}\nmax_poll_interval_ms = 10000\n[policy]\nmodel = \"{}\"\nthreads = 1\n\
             [trainer]\nbatch_size = 2\ncheckpoint_every = 1\nlr = 1e-4\n[trainer.lora]\nenabled = true\nrank = 4\nalpha = 8\n\
             [trainer.tenants]\nmode = \"per_tenant\"\nmin_batch = {min_batch}\nmax_tenants = {max_tenants}\n",
            model.display()
        ),
    )
    .unwrap();
}

/// [`Run`] for a per-tenant pipeline `name` ([`write_per_tenant_pipeline`]); `None` (reported as
/// missing) without the model.
fn per_tenant_run(name: &str, partitions: i32, min_batch: usize, max_tenants: usize) -> Option<Run> {
    let Some(model) = common::smollm2() else {
        common::missing("models/smollm2-135m-instruct missing (run scripts/setup.sh)");
        return None;
    };
    let dir = tempfile::tempdir().unwrap();
    let (lake, ck, pfile) = (dir.path().join("lake"), dir.path().join("ck"), dir.path().join("p.toml"));
    write_per_tenant_pipeline(&pfile, name, &model, partitions, min_batch, max_tenants);
    Some(Run { model, brokers: common::brokers(), prefix: common::prefix(), dir, lake, ck, pfile })
}

/// `samples` with tenant `tenants[i]` on sample i.
fn with_tenants(mut s: Vec<Sample>, tenants: &[&str]) -> Vec<Sample> {
    for (x, t) in s.iter_mut().zip(tenants) {
        x.tenant = Some(t.to_string());
    }
    s
}

/// (version, sample ids of its lineage) of every complete checkpoint in `dir`, ascending.
fn lineages(dir: &std::path::Path) -> Vec<(i64, Vec<String>)> {
    nextstate::trainer::scan(dir).unwrap().complete.iter().map(|(_, m)| (m.version, m.lineage.iter().map(|l| l.sample_id.clone()).collect())).collect()
}

fn ids(s: &[Sample]) -> Vec<String> {
    s.iter().map(|x| x.sample_id.clone()).collect()
}

/// Per-tenant training on the real broker (issue 41): interactions' samples of three tenants on a
/// 2-partition `samples` topic train three LoRA adapters on one base. Each tenant's checkpoints hold
/// only its own sample ids, in its own folder `<run>/<tenant>/<version>` with the tenant in the
/// manifest; alice's adapter equals (to 1e-6) an adapter trained on alice's samples alone from the same
/// seed, so nothing of another tenant reached it. carol's third sample is below `min_batch` = 2 at the
/// end: it waits, uncommitted, and a resumed run trains it together with carol's next sample (carol
/// v2) while alice's and bob's samples are skipped as consumed. One policy server then serves the three
/// adapters side by side, each tenant's request answered with its own adapter's log-probs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_tenant_adapters_train_only_their_own_samples() {
    let Some(Run { model, brokers, prefix, dir: _dir, lake, ck, pfile }) = per_tenant_run("fleet", 2, 2, 8) else {
        return;
    };
    let lm = LanguageModel::load(&model, &LoadOptions::default()).unwrap();
    let all = with_tenants(samples(&lm, 12, "fleet"), &["alice", "bob", "alice", "carol", "bob", "alice", "carol", "bob", "alice", "bob", "carol", "carol"]);
    drop(lm);
    let of = |t: &str, s: &[Sample]| -> Vec<Sample> { s.iter().filter(|x| x.tenant.as_deref() == Some(t)).cloned().collect() };
    let (alice, bob, carol) = (of("alice", &all), of("bob", &all), of("carol", &all));
    // first run: every sample but carol's last
    publish_samples(&brokers, &prefix, 2, &all[..11]).await;
    let out = train_until_idle(&pfile, &brokers, &prefix, &lake, &ck, &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{}", stdout, String::from_utf8_lossy(&out.stderr));
    let run_dir = ck.join("fleet");
    assert!(nextstate::trainer::latest_complete(&run_dir).unwrap().is_none(), "no shared checkpoint in a per-tenant run");
    assert_eq!(lineages(&run_dir.join("alice")), vec![(1, ids(&alice[..2])), (2, ids(&alice[2..]))]);
    assert_eq!(lineages(&run_dir.join("bob")), vec![(1, ids(&bob[..2])), (2, ids(&bob[2..]))]);
    assert_eq!(lineages(&run_dir.join("carol")), vec![(1, ids(&carol[..2]))]);
    assert!(stdout.contains("tenant carol: steps=1 samples_trained=2 version=Some(1) resumed_from=None waiting=1"), "{stdout}");
    let m = nextstate::trainer::Manifest::read(&run_dir.join("alice").join("2")).unwrap();
    assert_eq!((m.tenant.as_deref(), m.run_id.as_str(), m.to_row(&run_dir).unwrap().checkpoint_id), (Some("alice"), "fleet", "fleet/alice/2".to_string()));

    // alice's adapter is what alice's samples alone train from the same seed
    let cfg = nextstate::config::PipelineConfig::load(&pfile).unwrap();
    nextstate::model::set_threads(1).unwrap();
    tch::manual_seed(cfg.trainer.seed as i64);
    let opts = nextstate::stages::train::policy_load_options(&cfg).unwrap();
    let solo_dir = tempfile::tempdir().unwrap();
    let mut solo = Trainer::new(LanguageModel::load(&model, &opts).unwrap(), Method::Binary, cfg.trainer.clone(), CheckpointWriter::new(solo_dir.path(), "solo")).unwrap();
    for batch in alice.chunks(2) {
        assert!(solo.train_step(batch).unwrap().train_step.is_some());
    }
    let frozen = LoadOptions { trainable: Trainable::Frozen, ..opts.clone() };
    let served = LanguageModel::load_checkpoint(&run_dir.join("alice").join("2"), Some(&model), &frozen).unwrap();
    let want: HashMap<String, tch::Tensor> = solo.policy().transformer().adapter_state().into_iter().collect();
    let got = served.transformer().adapter_state();
    assert_eq!(got.len(), want.len());
    for (name, t) in &got {
        let d = (t - &want[name]).abs().max().double_value(&[]);
        assert!(d < 1e-6, "{name}: alice's per-tenant adapter differs from alice-only training by {d}");
    }
    let bob_adapter = LanguageModel::load_checkpoint(&run_dir.join("bob").join("2"), Some(&model), &frozen).unwrap().transformer().adapter_state();
    let d: f64 = got.iter().zip(&bob_adapter).map(|((_, a), (_, b))| (a - b).abs().max().double_value(&[])).fold(0.0, f64::max);
    assert!(d > 1e-6, "alice's and bob's adapters differ");
    drop((served, solo));

    // One server, the three adapters side by side (what the reload hook of `nextstate run` does with
    // each tenant's checkpoint): each tenant's answer carries its own adapter's log-probs.
    serve_tenants_side_by_side(&model, &run_dir, &[("alice", run_dir.join("alice/2"), 2), ("bob", run_dir.join("bob/2"), 2), ("carol", run_dir.join("carol/1"), 1)]).await;

    // second run: carol's waiting sample and her next one train v2; the rest is consumed already
    publish_samples(&brokers, &prefix, 2, &all[11..]).await;
    let out = train_until_idle(&pfile, &brokers, &prefix, &lake, &ck, &["--resume"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{}", stdout, String::from_utf8_lossy(&out.stderr));
    assert_eq!(lineages(&run_dir.join("carol")), vec![(1, ids(&carol[..2])), (2, ids(&carol[2..]))]);
    assert_eq!(lineages(&run_dir.join("alice")).len(), 2, "alice unchanged");
    assert_eq!(lineages(&run_dir.join("bob")).len(), 2, "bob unchanged");
    assert!(stdout.contains("tenant carol: steps=1 samples_trained=2 version=Some(2) resumed_from=Some(1) waiting=0"), "{stdout}");
}

/// Starts one policy server on `model` (the shared policy, version 0), loads the newest checkpoint of each
/// tenant of the per-tenant run folder `run_dir` as a resumed `nextstate run` does
/// (`stages::run::resume_tenants`: they must be the `(tenant, checkpoint, version)`s of `tenants`), and
/// checks that a greedy request naming the tenant in
/// `X-Agent-Id` is answered by that adapter: its reported log-probs equal a direct scoring of the same
/// tokens by the checkpoint loaded on its own (1e-5), and differ from the shared policy's.
async fn serve_tenants_side_by_side(model: &std::path::Path, run_dir: &std::path::Path, tenants: &[(&str, std::path::PathBuf, i64)]) {
    let (url, handle) = start_server(model).await;
    let loaded = nextstate::stages::run::resume_tenants(&handle, run_dir).await.unwrap();
    assert_eq!(loaded, tenants.iter().map(|(t, _, v)| (t.to_string(), *v)).collect(), "each tenant's newest checkpoint is loaded");
    let base = LanguageModel::load(model, &LoadOptions::default()).unwrap();
    let client = nextstate::net::http_client(None).unwrap();
    for (t, path, v) in tenants {
        let body = serde_json::json!({"messages": [{"role": "user", "content": "What is 3 plus 3? Answer briefly."}], "max_tokens": 8, "temperature": 0.0, "logprobs": true});
        let r: serde_json::Value = client.post(format!("{url}/v1/chat/completions")).header("x-agent-id", *t).json(&body).send().await.unwrap().json().await.unwrap();
        assert_eq!((r["policy_tenant"].as_str(), r["policy_version"].as_i64()), (Some(*t), Some(*v)), "{r}");
        let prompt: Vec<u32> = serde_json::from_value(r["prompt_token_ids"].clone()).unwrap();
        let toks: Vec<u32> = serde_json::from_value(r["choices"][0]["token_ids"].clone()).unwrap();
        let served: Vec<f32> = r["choices"][0]["logprobs"]["content"].as_array().unwrap().iter().map(|c| c["logprob"].as_f64().unwrap() as f32).collect();
        let own = LanguageModel::load_checkpoint(path, Some(model), &LoadOptions::default()).unwrap();
        let direct = own.score(&[(prompt.clone(), toks.clone())], 0).unwrap().remove(0).logprobs;
        let shared = base.score(&[(prompt, toks)], 0).unwrap().remove(0).logprobs;
        let (d_own, d_shared) = (max_abs_diff(&[served.clone()], &[direct]), max_abs_diff(&[served], &[shared]));
        eprintln!("tenant {t}: served vs its own adapter {d_own:e}, vs the shared policy {d_shared:e}");
        assert!(d_own < 1e-5, "tenant {t}: served log-probs differ from its adapter's by {d_own}");
        assert!(d_shared > 1e-5, "tenant {t}: served log-probs equal the shared policy's ({d_shared})");
    }
}

/// Bad tenants on the real broker (issue 41): with `max_tenants = 2`, a tenant whose adapter cannot be
/// opened (its checkpoint was trained with another method) and a third tenant beyond the cap have
/// their samples dead-lettered with the reason (`tenant_unavailable`, `tenant_cap`; each once, the
/// sample in the payload), while alice trains her two versions and the run ends normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_beyond_the_cap_or_unopenable_are_dead_lettered_and_the_others_train() {
    let Some(Run { model, brokers, prefix, dir: _dir, lake, ck, pfile }) = per_tenant_run("capped", 1, 2, 2) else {
        return;
    };
    // bob's adapter: a complete checkpoint of another method, which cannot be resumed
    let bob1 = ck.join("capped").join("bob").join("1");
    std::fs::create_dir_all(&bob1).unwrap();
    let manifest = serde_json::json!({
        "format": 1, "run_id": "capped", "tenant": "bob", "version": 1, "parent_version": 0, "step": 1, "method": "opd",
        "config_hash": "x", "weights_format": "lora", "weight_files": [],
        "optimizer": {"kind": "adamw", "step": 1, "lr": 1e-4, "betas": [0.9, 0.98], "eps": 1e-8, "weight_decay": 0.1, "file": "optimizer/optimizer.safetensors"},
        "metrics": [], "lineage": [], "created_time": 0
    });
    std::fs::write(bob1.join("manifest.json"), manifest.to_string()).unwrap();
    let lm = LanguageModel::load(&model, &LoadOptions::default()).unwrap();
    let all = with_tenants(samples(&lm, 7, "capped"), &["alice", "bob", "carol", "alice", "bob", "carol", "alice"]);
    drop(lm);
    publish_samples(&brokers, &prefix, 1, &all).await;
    let out = train_until_idle(&pfile, &brokers, &prefix, &lake, &ck, &["--resume"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{}", stdout, String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains(r#"refused (dead-lettered): {"tenant_cap": 2, "tenant_unavailable": 2}"#), "{stdout}");
    // alice: 3 samples, batches of 2, min_batch 2 → one step; the third waits
    assert_eq!(lineages(&ck.join("capped").join("alice")).iter().map(|(v, i)| (*v, i.len())).collect::<Vec<_>>(), vec![(1, 2)]);
    assert!(!ck.join("capped").join("carol").exists(), "no adapter for a tenant beyond the cap");
    let dead = nextstate::lake::Lake::open(&lake).unwrap().read_table::<nextstate::schema::DeadLetter>().unwrap();
    let mut got: Vec<(String, String, Option<String>)> = dead.iter().filter(|d| d.stage == "train").map(|d| (d.reason_code.clone(), d.input_key.clone().unwrap_or_default(), d.tenant.clone())).collect();
    got.sort();
    let mut want: Vec<(String, String, Option<String>)> = all
        .iter()
        .filter_map(|s| match s.tenant.as_deref() {
            Some("bob") => Some(("tenant_unavailable".to_string(), s.interaction_id.clone(), s.tenant.clone())),
            Some("carol") => Some(("tenant_cap".to_string(), s.interaction_id.clone(), s.tenant.clone())),
            _ => None,
        })
        .collect();
    want.sort();
    assert_eq!(got, want);
    let bob_reason = dead.iter().find(|d| d.reason_code == "tenant_unavailable").unwrap();
    assert!(bob_reason.reason.contains("trained with method opd"), "{}", bob_reason.reason);
}

/// The `tenant T: steps=N ...` lines of a `nextstate train` report, as (tenant, steps, resumed_from).
fn tenant_lines(log: &str) -> Vec<(String, i64, String)> {
    log.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("tenant ")?;
            let (t, rest) = rest.split_once(": steps=")?;
            let steps = rest.split_whitespace().next()?.parse().ok()?;
            let resumed = rest.split_whitespace().find_map(|w| w.strip_prefix("resumed_from="))?.to_string();
            Some((t.to_string(), steps, resumed))
        })
        .collect()
}

/// Waits up to `limit` for `done()`; false when it never held.
fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    done()
}

/// Scale-out of per-tenant training on the real broker (issue 41): two `nextstate train` processes in
/// one consumer group split four tenants, each tenant in its own partition of a 4-partition `samples`
/// topic (keyed by tenant); batches of 2, a checkpoint every 2 steps. Trainer A starts alone and trains
/// every tenant's v1 (4 samples), then one more step for alice, bob and erin that no checkpoint holds
/// yet, when trainer B joins the group (frank has nothing uncheckpointed). At that rebalance A hands over
/// every tenant that read from a partition it lost, frank too: the adapter is closed without a
/// checkpoint (the step is dropped) and nothing of the lost partition is committed from A. B reads the
/// handed-over samples again from the committed offsets and trains those tenants from A's v1. After more
/// samples (two for alice, bob, erin; four for frank), every tenant has exactly v1 (its first four
/// samples) and v2 (its next four, parent v1), trained by whichever process owned its partition: no
/// sample lost, none in two checkpoints, and both processes trained. Without the hand-over A would
/// write, at its stop, a v2 of B's tenants from its own diverging step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_trainer_processes_split_the_tenants_and_hand_over_at_a_rebalance() {
    let Some(Run { model, brokers, prefix, dir, lake, ck, pfile }) = per_tenant_run("split", 4, 2, 8) else {
        return;
    };
    let toml = std::fs::read_to_string(&pfile).unwrap().replace("checkpoint_every = 1", "checkpoint_every = 2");
    std::fs::write(&pfile, toml).unwrap();
    const TENANTS: [&str; 4] = ["alice", "bob", "erin", "frank"];
    let lm = LanguageModel::load(&model, &LoadOptions::default()).unwrap();
    let phase = |n: usize, ts: &[&'static str]| -> Vec<&'static str> { ts.iter().copied().cycle().take(n * ts.len()).collect() };
    let three = &TENANTS[..3];
    let tenants: Vec<&str> = [phase(4, &TENANTS), phase(2, three), phase(2, three), vec!["frank"; 4]].concat();
    let all = with_tenants(samples(&lm, tenants.len(), "split"), &tenants);
    drop(lm);
    let (first, second, third) = (&all[..16], &all[16..22], &all[22..]);
    let bus = nextstate::bus::Bus::connect(nextstate::bus::BusConfig { brokers: Some(brokers.clone()), topic_prefix: prefix.clone(), partitions: 4, ..Default::default() }).await.unwrap();
    bus.ensure_topics(&["samples", "train_steps", "checkpoints", "dead_letters"]).await.unwrap();
    let producer = bus.producer().unwrap();
    let mut partition_of: HashMap<String, i32> = HashMap::new();
    let publish = async |batch: &[Sample]| -> Vec<(String, i32)> {
        let mut out = vec![];
        for s in batch {
            out.push((s.tenant.clone().unwrap(), producer.send(s, None).await.unwrap().0));
        }
        producer.flush().unwrap();
        out
    };
    let mut keyed = |sent: Vec<(String, i32)>| {
        for (t, p) in sent {
            assert_eq!(*partition_of.entry(t).or_insert(p), p, "a tenant's samples stay in one partition");
        }
    };
    let sent = publish(first).await;
    let mut parts: Vec<i32> = sent.iter().map(|(_, p)| *p).collect();
    parts.sort();
    parts.dedup();
    assert_eq!(parts, vec![0, 1, 2, 3], "the four tenants are keyed into four partitions: {sent:?}");
    keyed(sent);

    let spawn = |id: &str| {
        let mut a = common::args(&["train", "--resume", "--group-instance-id", id, "--pipeline", &pfile.display().to_string(), "--brokers", &brokers, "--topic-prefix", &prefix]);
        a.extend(common::args(&["--lake", &lake.display().to_string(), "--checkpoints", &ck.display().to_string()]));
        common::Proc::spawn_with_env(id, &a, &[("RUST_LOG", "info,rdkafka=warn,nextstate::bus=debug")], &dir.path().join(format!("{id}.log")))
    };
    let log = |p: &common::Proc| std::fs::read_to_string(&p.log).unwrap_or_default();
    let steps_logged = |p: &common::Proc| log(p).lines().filter(|l| l.contains("train step")).count();
    let run_dir = ck.join("split");
    let versions = |t: &str| lineages(&run_dir.join(t)).len();
    let mut a = spawn("trainer-a");
    assert!(wait_until(Duration::from_secs(300), || TENANTS.iter().all(|t| versions(t) >= 1)), "trainer A trains every tenant's v1:\n{}", a.log_tail(40));
    // one more step for alice, bob and erin, which no checkpoint holds yet, when B joins
    keyed(publish(second).await);
    assert!(wait_until(Duration::from_secs(300), || steps_logged(&a) >= 11), "trainer A takes a third step for three tenants:\n{}", a.log_tail(40));
    let mut b = spawn("trainer-b");
    assert!(
        wait_until(Duration::from_secs(120), || log(&b).lines().any(|l| l.contains("assigned") && l.contains("samples\"")) && log(&a).contains("tenant handed over")),
        "B is assigned partitions and A hands over tenants:\n--- A\n{}\n--- B\n{}",
        a.log_tail(30),
        b.log_tail(30)
    );
    keyed(publish(third).await);
    assert!(wait_until(Duration::from_secs(300), || TENANTS.iter().all(|t| versions(t) >= 2)), "every tenant's v2 is trained:\n--- A\n{}\n--- B\n{}", a.log_tail(40), b.log_tail(40));
    a.term();
    b.term();
    for p in [&mut a, &mut b] {
        let status = p.wait_for(Duration::from_secs(120)).expect("the trainer stops after SIGTERM");
        assert!(status.success(), "{} failed ({status}):\n{}", p.name, p.log_tail(40));
    }
    let (la, lb) = (log(&a), log(&b));
    for t in TENANTS {
        let mine = |s: &[Sample]| -> Vec<String> { s.iter().filter(|x| x.tenant.as_deref() == Some(t)).map(|x| x.sample_id.clone()).collect() };
        let mut v2 = mine(second);
        v2.extend(mine(third));
        assert_eq!(lineages(&run_dir.join(t)), vec![(1, mine(first)), (2, v2)], "tenant {t}: v1 from its first four samples, v2 from its next four, each once");
        assert_eq!(nextstate::trainer::Manifest::read(&run_dir.join(t).join("2")).unwrap().parent_version, 1, "tenant {t}: v2 continues v1");
        // A: 2 steps to v1 and (not frank) the handed-over one; the owner of its partition: 2 more to v2
        let steps: i64 = tenant_lines(&la).iter().chain(&tenant_lines(&lb)).filter(|(n, _, _)| n == t).map(|(_, s, _)| s).sum();
        assert_eq!(steps, if t == "frank" { 4 } else { 5 }, "tenant {t}: 2 + 1 handed over + 2\n--- A\n{la}\n--- B\n{lb}");
    }
    let b_tenants: Vec<(String, i64, String)> = tenant_lines(&lb).into_iter().filter(|(_, s, _)| *s > 0).collect();
    let handed = la.lines().find(|l| l.starts_with("handed over at rebalances")).unwrap_or_else(|| panic!("A reports what it handed over:\n{la}"));
    eprintln!("A: {handed}; B trained {b_tenants:?}");
    assert!(!b_tenants.is_empty() && b_tenants.len() < TENANTS.len(), "each process trained some tenants' v2: B {b_tenants:?}");
    assert!(b_tenants.iter().all(|(_, s, r)| *s == 2 && r == "Some(1)"), "B trained v2 of its tenants from A's v1: {b_tenants:?}");
    for (t, _, _) in &b_tenants {
        let n = if t == "frank" { 0 } else { 2 };
        assert!(handed.contains(&format!("\"{t}\": {n}")), "A handed over {t} ({n} samples trained since v1): {handed}");
    }
}

/// Continuous per-tenant training on the real broker with `max_wait_s = 2`, `min_batch = 1`, batches
/// of 2: alice's three samples train one full batch at once (v1), and her third, alone, trains as a
/// partial batch once it has waited 2 s (v2) while the trainer keeps reading; bob's single sample with
/// `min_batch` 1 likewise (v1). Without the maximum wait both would wait for more samples forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continuous_per_tenant_training_trains_a_partial_batch_past_max_wait() {
    let Some(Run { model, brokers, prefix, dir, lake, ck, pfile }) = per_tenant_run("waited", 1, 1, 8) else {
        return;
    };
    let toml = std::fs::read_to_string(&pfile).unwrap() + "max_wait_s = 2\n";
    std::fs::write(&pfile, toml).unwrap();
    let lm = LanguageModel::load(&model, &LoadOptions::default()).unwrap();
    let all = with_tenants(samples(&lm, 4, "waited"), &["alice", "alice", "bob", "alice"]);
    drop(lm);
    publish_samples(&brokers, &prefix, 1, &all).await;
    let mut a = common::args(&["train", "--group-instance-id", "trainer-w", "--pipeline", &pfile.display().to_string(), "--brokers", &brokers, "--topic-prefix", &prefix]);
    a.extend(common::args(&["--lake", &lake.display().to_string(), "--checkpoints", &ck.display().to_string()]));
    let mut p = common::Proc::spawn("trainer-w", &a, &dir.path().join("w.log"));
    let run_dir = ck.join("waited");
    let done = || lineages(&run_dir.join("alice")).len() == 2 && lineages(&run_dir.join("bob")).len() == 1;
    assert!(wait_until(Duration::from_secs(240), done), "alice's and bob's partial batches train past the wait:\n{}", p.log_tail(40));
    p.term();
    let status = p.wait_for(Duration::from_secs(120)).expect("stops after SIGTERM");
    assert!(status.success(), "{}", p.log_tail(40));
    assert_eq!(lineages(&run_dir.join("alice")), vec![(1, ids(&all[..2])), (2, ids(&all[3..]))]);
    assert_eq!(lineages(&run_dir.join("bob")), vec![(1, ids(&all[2..3]))]);
}
