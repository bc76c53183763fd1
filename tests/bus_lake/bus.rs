//! The Kafka bus against a real Kafka-protocol broker (noida-db from scripts/broker.sh, or
//! NEXTSTATE_TEST_BROKERS): topic creation, produce/consume across partitions, consumer-group
//! rebalance, offset commit and resume.
use crate::common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use nextstate::bus::{Bus, BusConfig};
use nextstate::runtime::InputLoop;
use nextstate::schema::{DeadLetter, Lineage};

fn cfg(prefix: &str) -> BusConfig {
    BusConfig { brokers: Some(common::brokers()), topic_prefix: prefix.to_string(), partitions: 3, ..Default::default() }
}

/// [`cfg`] with `partitions`, a 10 s `max.poll.interval.ms` and membership `instance` (static when set).
fn member_cfg(prefix: &str, partitions: i32, instance: Option<String>) -> BusConfig {
    BusConfig { partitions, max_poll_interval_ms: 10_000, group_instance_id: instance, ..cfg(prefix) }
}

fn record(i: usize) -> DeadLetter {
    DeadLetter::new("test", "t", "r", format!("{i}").as_bytes(), Lineage { source_line: Some(i as i64), ..Default::default() })
        .with_keys(&format!("session-{}", i % 7), None)
}

async fn drain(input: &mut InputLoop, want: usize, limit: Duration) -> Vec<nextstate::runtime::InMsg> {
    let deadline = tokio::time::Instant::now() + limit;
    let mut got = vec![];
    while got.len() < want && tokio::time::Instant::now() < deadline {
        got.extend(input.next_batch(500, Duration::from_millis(500)).await.unwrap());
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn produce_consume_across_partitions_with_commit_and_resume() {
    let prefix = common::prefix();
    let bus = Bus::connect(cfg(&prefix)).await.unwrap();
    assert!(!bus.is_embedded());
    bus.ensure_topics(&["dead_letters"]).await.unwrap();
    bus.ensure_topics(&["dead_letters"]).await.unwrap(); // idempotent
    let topic = bus.topic("dead_letters");
    let marks = bus.watermarks(&topic).await.unwrap();
    assert_eq!(marks.len(), 3, "topic created with 3 partitions");

    let p = bus.producer().unwrap();
    let mut by_session: HashMap<String, HashSet<i32>> = HashMap::new();
    for i in 0..60 {
        let r = record(i);
        let (part, _) = p.send(&r, None).await.unwrap();
        by_session.entry(r.session_id.clone()).or_default().insert(part);
    }
    // keyed by session: one session, one partition; 7 sessions spread over more than one partition
    assert!(by_session.values().all(|s| s.len() == 1));
    let used: HashSet<i32> = by_session.values().flatten().copied().collect();
    assert!(used.len() > 1, "sessions spread over partitions: {used:?}");

    let group = format!("{prefix}g");
    let mut input = InputLoop::new(&bus, &group, &topic).unwrap();
    let first = drain(&mut input, 60, Duration::from_secs(30)).await;
    assert_eq!(first.len(), 60);
    // commit only the first 10 records of each partition, then a new consumer of the group resumes there
    let mut commit = HashMap::new();
    let mut expect_rest = 0;
    for part in used.iter() {
        let mut offs: Vec<i64> = first.iter().filter(|m| m.partition == *part).map(|m| m.offset).collect();
        offs.sort();
        let keep = offs.len().min(10);
        commit.insert(*part, offs[0] + keep as i64);
        expect_rest += offs.len() - keep;
    }
    input.commit(&commit).unwrap();
    drop(input);
    let mut again = InputLoop::new(&bus, &group, &topic).unwrap();
    let rest = drain(&mut again, expect_rest, Duration::from_secs(30)).await;
    assert_eq!(rest.len(), expect_rest, "resumed from the committed offsets");
    for m in &rest {
        assert!(m.offset >= commit[&m.partition]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_consumer_joining_the_group_takes_over_partitions() {
    let prefix = common::prefix();
    let bus = Bus::connect(cfg(&prefix)).await.unwrap();
    bus.ensure_topics(&["dead_letters"]).await.unwrap();
    let topic = bus.topic("dead_letters");
    let group = format!("{prefix}g");
    let mut a = InputLoop::new(&bus, &group, &topic).unwrap();
    // wait for the first member to own all partitions
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while a.assigned().len() < 3 && tokio::time::Instant::now() < deadline {
        a.next_batch(10, Duration::from_millis(300)).await.unwrap();
    }
    assert_eq!(a.assigned().len(), 3);
    let mut b = InputLoop::new(&bus, &group, &topic).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    while (b.assigned().is_empty() || a.assigned().len() == 3) && tokio::time::Instant::now() < deadline {
        let (_ra, _rb) = tokio::join!(a.next_batch(10, Duration::from_millis(300)), b.next_batch(10, Duration::from_millis(300)));
    }
    let (pa, pb) = (a.assigned(), b.assigned());
    assert!(!pb.is_empty(), "second member got partitions");
    assert_eq!(pa.len() + pb.len(), 3, "partitions split without overlap: {pa:?} {pb:?}");
    assert!(pa.iter().all(|p| !pb.contains(p)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_mock_cluster_round_trip() {
    let bus = Bus::connect(BusConfig::default()).await.unwrap();
    assert!(bus.is_embedded());
    bus.ensure_topics(&["dead_letters"]).await.unwrap();
    let p = bus.producer().unwrap();
    for i in 0..20 {
        p.send(&record(i), None).await.unwrap();
    }
    let mut input = InputLoop::new(&bus, "g", &bus.topic("dead_letters")).unwrap();
    let got = drain(&mut input, 20, Duration::from_secs(30)).await;
    assert_eq!(got.len(), 20);
}

/// A consumer that joined before any record was produced still reads every record (regression: with
/// the mock cluster, records produced while the group was forming were skipped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_started_before_the_producer_reads_from_the_beginning() {
    for brokers in [None, Some(common::brokers())] {
        let prefix = common::prefix();
        let bus = Bus::connect(BusConfig { brokers, topic_prefix: prefix.clone(), partitions: 3, ..Default::default() }).await.unwrap();
        bus.ensure_topics(&["dead_letters"]).await.unwrap();
        let topic = bus.topic("dead_letters");
        let mut input = InputLoop::new(&bus, &format!("{prefix}g"), &topic).unwrap();
        let p = bus.producer().unwrap();
        // a burst with many sends in flight, as `nextstate ingest` produces
        let feeder = tokio::spawn(async move {
            let recs: Vec<_> = (0..300).map(record).collect();
            let sends = recs.iter().map(|r| p.send(r, None));
            for r in futures::future::join_all(sends).await {
                r.unwrap();
            }
        });
        let got = drain(&mut input, 300, Duration::from_secs(30)).await;
        feeder.await.unwrap();
        let mut offs: Vec<(i32, i64)> = got.iter().map(|m| (m.partition, m.offset)).collect();
        offs.sort();
        assert_eq!(got.len(), 300, "embedded={} first offsets {:?}", bus.is_embedded(), &offs[..offs.len().min(5)]);
    }
}

/// A consumer that dies without leaving its group (a crash) must not stall the next one. Measures the
/// time until a new member gets partitions, with dynamic and with static membership.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_member_does_not_stall_its_group() {
    for instance in [Some("host-a".to_string()), None] {
        let prefix = common::prefix();
        let bus = Bus::connect(member_cfg(&prefix, 2, instance.clone())).await.unwrap();
        bus.ensure_topics(&["dead_letters"]).await.unwrap();
        let topic = bus.topic("dead_letters");
        let group = format!("{prefix}g");
        let mut a = InputLoop::new(&bus, &group, &topic).unwrap();
        let t0 = std::time::Instant::now();
        while a.assigned().is_empty() && t0.elapsed() < Duration::from_secs(60) {
            a.next_batch(10, Duration::from_millis(200)).await.unwrap();
        }
        assert!(!a.assigned().is_empty());
        std::mem::forget(a); // a crash: no LeaveGroup
        let mut b = InputLoop::new(&bus, &group, &topic).unwrap();
        let t1 = std::time::Instant::now();
        while b.assigned().is_empty() && t1.elapsed() < Duration::from_secs(90) {
            b.next_batch(10, Duration::from_millis(200)).await.unwrap();
        }
        eprintln!("membership {:?}: new member assigned after {:.1} s", instance, t1.elapsed().as_secs_f64());
        assert!(!b.assigned().is_empty(), "membership {instance:?}: the group stalled after a crash");
    }
}

/// The embedded (mock) cluster keeps at most 5 MiB per partition, and an append that has to evict
/// every older message set also makes the new one unreadable (librdkafka's mock sets the log start
/// past it). Records of up to the embedded record limit, sent one after another to one partition,
/// are all read; a larger record is refused with `RecordTooLarge` instead of being lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_bus_delivers_every_record_up_to_its_limit_and_refuses_larger_ones() {
    use nextstate::bus::flow::EMBEDDED_MAX_RECORD_BYTES;
    let bus = Bus::connect(BusConfig { partitions: 1, ..Default::default() }).await.unwrap();
    assert!(bus.is_embedded());
    bus.ensure_topics(&["dead_letters"]).await.unwrap();
    let topic = bus.topic("dead_letters");
    bus.expect_consumer("g", "dead_letters");
    let mut input = InputLoop::new(&bus, "g", &topic).unwrap();
    let p = bus.producer().unwrap();
    let near = EMBEDDED_MAX_RECORD_BYTES as usize - 1024;
    let sizes = [10, near, 1000, near, near, 10, near];
    let mut read = vec![];
    for (i, n) in sizes.iter().enumerate() {
        let payload = vec![b'x'; *n];
        let (_, offset) = p.send_raw(&topic, &format!("k{i}"), &payload).await.unwrap();
        assert_eq!(offset, i as i64);
        let got = drain(&mut input, 1, Duration::from_secs(20)).await;
        assert_eq!(got.len(), 1, "record {i} of {n} bytes was not delivered");
        read.push((got[0].offset, got[0].payload.len()));
    }
    assert_eq!(read, sizes.iter().enumerate().map(|(i, n)| (i as i64, *n)).collect::<Vec<_>>());
    let huge = vec![b'x'; 6 << 20];
    match p.send_raw(&topic, "huge", &huge).await {
        Err(nextstate::Error::RecordTooLarge { bytes, limit, .. }) => assert_eq!((bytes, limit), (6 << 20, EMBEDDED_MAX_RECORD_BYTES)),
        other => panic!("a 6 MiB record on the embedded bus: {other:?}"),
    }
    // The bus still works after the refusal.
    p.send_raw(&topic, "after", b"ok").await.unwrap();
    assert_eq!(drain(&mut input, 1, Duration::from_secs(20)).await.len(), 1);
}

/// SASL settings: the password comes from the environment variable `[bus.secret_env]` names; an unset
/// variable is a configuration error naming the variable; librdkafka is built with SSL and SCRAM (it
/// accepts `SASL_SSL` with `SCRAM-SHA-512`, which a build without OpenSSL refuses).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sasl_scram_settings_take_the_password_from_the_environment() {
    let var = format!("NEXTSTATE_TEST_KAFKA_PASSWORD_{}", std::process::id());
    let c = BusConfig {
        brokers: Some("127.0.0.1:1".into()),
        properties: [("security.protocol", "SASL_SSL"), ("sasl.mechanisms", "SCRAM-SHA-512"), ("sasl.username", "nextstate")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        secret_env: [("sasl.password".to_string(), var.clone())].into_iter().collect(),
        ..BusConfig::default()
    };
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains(&var) && e.contains("sasl.password"), "{e}");
    std::env::set_var(&var, "s3cret-value");
    let client = c.client_config("127.0.0.1:1").unwrap();
    assert_eq!(client.get("sasl.password"), Some("s3cret-value"));
    assert_eq!(client.get("sasl.mechanisms"), Some("SCRAM-SHA-512"));
    let p: Result<rdkafka::producer::BaseProducer, _> = client.create();
    assert!(p.is_ok(), "librdkafka refused SASL_SSL/SCRAM: {:?}", p.err());
    // The configuration's Debug output never shows the secret (only variable names are stored).
    assert!(!format!("{c:?}").contains("s3cret-value"));
}

/// A static member (`group.instance.id`) fenced by another consumer with the same id hits a fatal
/// error and never delivers again. The loop replaces its consumer in-process (new generation, a
/// rebalance reported) and reads again from the group's committed offsets: nothing uncommitted is
/// lost, nothing committed is read twice. (Found in CI: after a noida-db restart a sink's commit raced
/// its own rejoin, was fenced, and the whole `run` exited; tests/e2e/chaos/broker.rs.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_static_member_is_replaced_and_reads_again_from_the_committed_offsets() {
    let prefix = common::prefix();
    let bus = Bus::connect(member_cfg(&prefix, 1, Some("host-a".to_string()))).await.unwrap();
    bus.ensure_topics(&["dead_letters"]).await.unwrap();
    let topic = bus.topic("dead_letters");
    let p = bus.producer().unwrap();
    for i in 0..20 {
        p.send(&record(i), None).await.unwrap();
    }
    let group = format!("{prefix}g");
    let mut a = InputLoop::new(&bus, &group, &topic).unwrap();
    let first = drain(&mut a, 20, Duration::from_secs(30)).await;
    assert_eq!(first.iter().map(|m| m.offset).collect::<Vec<_>>(), (0..20).collect::<Vec<i64>>());
    a.commit(&HashMap::from([(0, 5)])).unwrap();
    a.rebalanced();
    assert_eq!(a.generation(), 0);

    // The same instance id joins from another consumer: `a` is fenced.
    let mut b = InputLoop::new(&bus, &group, &topic).unwrap();
    let t0 = std::time::Instant::now();
    while b.assigned().is_empty() && t0.elapsed() < Duration::from_secs(60) {
        b.next_batch(10, Duration::from_millis(200)).await.unwrap();
    }
    assert!(!b.assigned().is_empty(), "the second consumer of the instance id was not assigned");
    drop(b);

    let t1 = std::time::Instant::now();
    let mut again = vec![];
    let mut rebalanced = false;
    while (a.generation() == 0 || again.len() < 15) && t1.elapsed() < Duration::from_secs(90) {
        // What a caller does after a durable write: commit (a failed commit is logged and passed over).
        let _ = a.commit(&HashMap::from([(0, 5)]));
        let got = a.next_batch(100, Duration::from_millis(300)).await.expect("a fenced consumer is replaced, not an error");
        rebalanced |= a.rebalanced();
        if a.generation() > 0 {
            again.extend(got);
        }
    }
    eprintln!("replaced after {:.1} s", t1.elapsed().as_secs_f64());
    assert_eq!(a.generation(), 1, "the fenced consumer was replaced once");
    assert!(rebalanced, "the replacement is reported as a rebalance");
    assert_eq!(again.iter().map(|m| m.offset).collect::<Vec<_>>(), (5..20).collect::<Vec<i64>>(), "read again from the committed offset 5, once each");
}
