// The local stack's Kafka chores, through Kafka's own client (kafka-clients, on the classpath).
// Run from scripts/stack.sh as a single-file program (Java 11+):
//
//   java -cp "$KAFKA_LIB/*" scripts/kafka/StackAdmin.java ready BOOTSTRAP TIMEOUT_S [PID]
//       Waits until the broker answers a real request: cluster metadata, then a record produced
//       with acks=all to sluice.stack.ready (created with 1 partition if missing) and
//       acknowledged. Exit 0 when it is; 1 after TIMEOUT_S seconds, or as soon as process PID
//       (the broker) has exited.
//   java -cp "$KAFKA_LIB/*" scripts/kafka/StackAdmin.java topics BOOTSTRAP NAME:PARTITIONS[:compact]...
//       Creates each topic that does not exist (replication factor 1) and waits until the
//       metadata shows it with all its partitions led. Exit 0, or 1 with a message.
//
// Quiet on success: the client's own logging goes where log4j is told (stack.sh: a file).
import java.time.Duration;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.Set;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AdminClientConfig;
import org.apache.kafka.clients.admin.CreateTopicsResult;
import org.apache.kafka.clients.admin.DescribeClusterOptions;
import org.apache.kafka.clients.admin.NewTopic;
import org.apache.kafka.clients.admin.TopicDescription;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.TopicPartitionInfo;
import org.apache.kafka.common.errors.TopicExistsException;
import org.apache.kafka.common.errors.UnknownTopicOrPartitionException;
import org.apache.kafka.common.serialization.ByteArraySerializer;

public class StackAdmin {
    static final String READY_TOPIC = "sluice.stack.ready";
    // How long `topics` waits for the metadata to show the new topics.
    static final long TOPICS_TIMEOUT_MS = 30_000;

    public static void main(String[] args) {
        int code;
        try {
            code = run(args);
        } catch (Exception e) {
            System.err.println("StackAdmin: " + describe(e));
            code = 1;
        }
        // Exit now: the clients' threads would otherwise keep the JVM alive a while.
        System.exit(code);
    }

    static int run(String[] args) throws Exception {
        if (args.length >= 3 && args[0].equals("ready")) {
            long pid = args.length > 3 ? Long.parseLong(args[3]) : -1;
            return ready(args[1], Long.parseLong(args[2]) * 1000, pid);
        }
        if (args.length >= 3 && args[0].equals("topics")) {
            Map<String, Integer> wanted = new LinkedHashMap<>();
            Set<String> compacted = new java.util.HashSet<>();
            for (int i = 2; i < args.length; i++) {
                String[] parts = args[i].split(":");
                boolean compact = parts.length == 3 && parts[2].equals("compact");
                if (parts.length != 2 && !compact || parts[0].isEmpty()) {
                    throw new IllegalArgumentException("expected NAME:PARTITIONS[:compact], got " + args[i]);
                }
                wanted.put(parts[0], Integer.parseInt(parts[1]));
                if (compact) compacted.add(parts[0]);
            }
            ensure(admin(args[1]), wanted, compacted, TOPICS_TIMEOUT_MS);
            return 0;
        }
        System.err.println("usage: StackAdmin ready BOOTSTRAP TIMEOUT_S [PID] | topics BOOTSTRAP NAME:PARTITIONS[:compact]...");
        return 2;
    }

    static Properties common(String bootstrap) {
        Properties p = new Properties();
        p.put(AdminClientConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        // A broker that is still starting refuses connections: retry soon, not after up to 1 s.
        p.put(AdminClientConfig.RECONNECT_BACKOFF_MS_CONFIG, "50");
        p.put(AdminClientConfig.RECONNECT_BACKOFF_MAX_MS_CONFIG, "250");
        p.put(AdminClientConfig.RETRY_BACKOFF_MS_CONFIG, "100");
        p.put(AdminClientConfig.RETRY_BACKOFF_MAX_MS_CONFIG, "250");
        p.put(AdminClientConfig.REQUEST_TIMEOUT_MS_CONFIG, "5000");
        return p;
    }

    static Admin admin(String bootstrap) {
        Properties p = common(bootstrap);
        p.put(AdminClientConfig.DEFAULT_API_TIMEOUT_MS_CONFIG, "10000");
        return Admin.create(p);
    }

    static int ready(String bootstrap, long timeoutMs, long pid) throws Exception {
        long deadline = System.currentTimeMillis() + timeoutMs;
        Properties pp = common(bootstrap);
        pp.put(ProducerConfig.ACKS_CONFIG, "all");
        pp.put(ProducerConfig.MAX_BLOCK_MS_CONFIG, "5000");
        pp.put(ProducerConfig.DELIVERY_TIMEOUT_MS_CONFIG, "10000");
        pp.put(ProducerConfig.KEY_SERIALIZER_CLASS_CONFIG, ByteArraySerializer.class.getName());
        pp.put(ProducerConfig.VALUE_SERIALIZER_CLASS_CONFIG, ByteArraySerializer.class.getName());
        String last = "no answer yet";
        // The clients are not closed: main() exits the JVM, and a close would wait out a send
        // still queued after a timeout.
        Admin admin = admin(bootstrap);
        KafkaProducer<byte[], byte[]> producer = new KafkaProducer<>(pp);
        while (true) {
            long left = deadline - System.currentTimeMillis();
            if (left <= 0) break;
            if (pid > 0 && !ProcessHandle.of(pid).map(ProcessHandle::isAlive).orElse(false)) {
                System.err.println("StackAdmin: the broker (pid " + pid + ") exited before it was ready");
                return 1;
            }
            try {
                admin.describeCluster(new DescribeClusterOptions().timeoutMs((int) Math.min(left, 2000))).nodes().get();
                ensure(admin, Map.of(READY_TOPIC, 1), Set.of(), Math.min(left, 10_000));
                producer.send(new ProducerRecord<>(READY_TOPIC, "ready".getBytes()))
                    .get(Math.max(1, deadline - System.currentTimeMillis()), TimeUnit.MILLISECONDS);
                return 0;
            } catch (Exception e) {
                last = describe(e);
                Thread.sleep(100);
            }
        }
        System.err.println("StackAdmin: broker " + bootstrap + " not ready after " + timeoutMs / 1000 + " s: " + last);
        return 1;
    }

    // Creates the missing topics and waits until each is in the metadata with every partition
    // led. A topic that already exists is fine (a warning if its partition count differs).
    // Topics in `compacted` keep the latest record per key (cleanup.policy=compact).
    static void ensure(Admin admin, Map<String, Integer> wanted, Set<String> compacted, long timeoutMs) throws Exception {
        long deadline = System.currentTimeMillis() + timeoutMs;
        Set<String> existing = admin.listTopics().names().get();
        List<NewTopic> create = new ArrayList<>();
        for (Map.Entry<String, Integer> t : wanted.entrySet()) {
            if (existing.contains(t.getKey())) continue;
            NewTopic topic = new NewTopic(t.getKey(), t.getValue(), (short) 1);
            if (compacted.contains(t.getKey())) topic.configs(Map.of("cleanup.policy", "compact"));
            create.add(topic);
        }
        for (String name : existing) {
            Integer want = wanted.get(name);
            if (want == null) continue;
            int have = admin.describeTopics(List.of(name)).allTopicNames().get().get(name).partitions().size();
            if (have != want) {
                System.err.println("StackAdmin: warning: topic " + name + " already exists with " + have
                    + " partitions, not " + want + "; kept as it is");
            }
        }
        if (!create.isEmpty()) {
            CreateTopicsResult result = admin.createTopics(create);
            for (Map.Entry<String, ? extends org.apache.kafka.common.KafkaFuture<Void>> f : result.values().entrySet()) {
                try {
                    f.getValue().get();
                } catch (ExecutionException e) {
                    // Created meanwhile by someone else: as good as created by us.
                    if (!(e.getCause() instanceof TopicExistsException)) {
                        throw new Exception("creating topic " + f.getKey() + " failed: " + describe(e), e);
                    }
                }
            }
        }
        // KRaft: creation is committed by the controller; the broker's metadata follows shortly.
        Map<String, String> pending = new HashMap<>();
        while (true) {
            pending.clear();
            Map<String, TopicDescription> described = new HashMap<>();
            for (Map.Entry<String, ? extends org.apache.kafka.common.KafkaFuture<TopicDescription>> f :
                    admin.describeTopics(wanted.keySet()).topicNameValues().entrySet()) {
                try {
                    described.put(f.getKey(), f.getValue().get());
                } catch (ExecutionException e) {
                    if (!(e.getCause() instanceof UnknownTopicOrPartitionException)) throw e;
                    pending.put(f.getKey(), "not in the metadata yet");
                }
            }
            for (Map.Entry<String, TopicDescription> d : described.entrySet()) {
                List<TopicPartitionInfo> parts = d.getValue().partitions();
                int want = wanted.get(d.getKey());
                if (parts.stream().anyMatch(p -> p.leader() == null || p.leader().isEmpty())) {
                    pending.put(d.getKey(), "partitions without a leader");
                } else if (parts.size() != want && !existing.contains(d.getKey())) {
                    pending.put(d.getKey(), parts.size() + " of " + want + " partitions");
                }
            }
            if (pending.isEmpty()) return;
            if (System.currentTimeMillis() > deadline) {
                throw new Exception("topics not ready after " + timeoutMs / 1000 + " s: " + pending);
            }
            Thread.sleep(100);
        }
    }

    static String describe(Throwable e) {
        while ((e instanceof ExecutionException || e.getCause() != null && e.getMessage() == null) && e.getCause() != null) {
            e = e.getCause();
        }
        return e.getClass().getSimpleName() + (e.getMessage() == null ? "" : ": " + e.getMessage());
    }
}
