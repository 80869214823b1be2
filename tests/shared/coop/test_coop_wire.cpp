// The cooperative-release datagram parser and the rate limiter: what a listener accepts from
// anyone on the node.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <random>

#include "gpustitch/coop/channel.h"
#include "gpustitch/coop/wire.h"

using namespace gpustitch::coop;

namespace {
Message sample() {
  Message m;
  m.kind = Kind::request;
  m.id = 0x1122334455667788ull;
  for (std::size_t i = 0; i < kUuidBytes; ++i) m.uuid[i] = static_cast<std::uint8_t>(i * 7);
  m.bytes = 3ull << 30;
  m.origin_pid = 4242;
  return m;
}
std::array<std::uint8_t, kMessageBytes> encoded(const Message& m) {
  std::array<std::uint8_t, kMessageBytes> b{};
  encode(m, b);
  return b;
}
}  // namespace

TEST(CoopWire, RoundTripsEveryField) {
  Message m = sample();
  auto b = encoded(m);
  auto d = decode(b);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->kind, Kind::request);
  EXPECT_EQ(d->id, m.id);
  EXPECT_EQ(std::memcmp(d->uuid, m.uuid, kUuidBytes), 0);
  EXPECT_EQ(d->bytes, m.bytes);
  EXPECT_EQ(d->origin_pid, 4242);
  m.kind = Kind::reply;
  m.status = ReplyStatus::rate_limited;
  d = decode(encoded(m));
  ASSERT_TRUE(d);
  EXPECT_EQ(d->kind, Kind::reply);
  EXPECT_EQ(d->status, ReplyStatus::rate_limited);
}

TEST(CoopWire, RejectsWrongSizesAndBadFields) {
  auto b = encoded(sample());
  EXPECT_FALSE(decode(std::span<const std::uint8_t>(b.data(), 63)));
  std::vector<std::uint8_t> longer(b.begin(), b.end());
  longer.push_back(0);
  EXPECT_FALSE(decode(longer));
  EXPECT_FALSE(decode({}));
  auto bad = [&](std::size_t off, std::uint8_t v) {
    auto c = b;
    c[off] = v;
    return decode(c).has_value();
  };
  EXPECT_FALSE(bad(0, 0));      // magic
  EXPECT_FALSE(bad(4, 2));      // version
  EXPECT_FALSE(bad(6, 3));      // kind
  EXPECT_FALSE(bad(6, 0));      // kind 0
  EXPECT_FALSE(bad(39, 0x01));  // bytes >= 2^56 > kMaxBytes
  EXPECT_FALSE(bad(43, 0x80));  // negative origin pid
  EXPECT_FALSE(bad(44, 1));     // status in a request
  EXPECT_TRUE(bad(50, 0xff));   // reserved bytes are ignored (room for later versions)
  Message r = sample();
  r.kind = Kind::reply;
  auto rb = encoded(r);
  rb[44] = 4;  // no such status
  EXPECT_FALSE(decode(rb));
}

TEST(CoopWire, RandomBytesNeverDecodeIntoSomethingOutOfRange) {
  std::mt19937_64 rng(1);
  for (int i = 0; i < 200000; ++i) {
    std::array<std::uint8_t, kMessageBytes> b;
    for (auto& x : b) x = static_cast<std::uint8_t>(rng());
    if (i % 2 == 0) {  // keep the header valid half of the time so the fields get checked
      auto good = encoded(sample());
      std::memcpy(b.data(), good.data(), 8);
    }
    if (auto d = decode(b)) {
      EXPECT_LE(d->bytes, kMaxBytes);
      EXPECT_GE(d->origin_pid, 0);
      EXPECT_TRUE(d->kind == Kind::request || d->kind == Kind::reply);
    }
  }
}

TEST(CoopTokenBucket, AllowsTheBurstThenTheRate) {
  TokenBucket bucket(4, 4);
  std::uint64_t t = 1'000'000'000;
  int taken = 0;
  for (int i = 0; i < 100; ++i) taken += bucket.take(t) ? 1 : 0;
  EXPECT_EQ(taken, 4);
  t += 500'000'000;  // half a second: two more
  taken = 0;
  for (int i = 0; i < 100; ++i) taken += bucket.take(t) ? 1 : 0;
  EXPECT_EQ(taken, 2);
  t += 100'000'000'000;  // long idle: never more than the burst
  taken = 0;
  for (int i = 0; i < 100; ++i) taken += bucket.take(t) ? 1 : 0;
  EXPECT_EQ(taken, 4);
}

TEST(CoopSocket, TheKernelSaysWhoSentADatagram) {
  auto listener = Socket::listen(getpid(), 12345, "coop-wire-test");
  ASSERT_TRUE(listener);
  auto sender = Socket::ephemeral();
  ASSERT_TRUE(sender);
  ASSERT_TRUE(sender->send_to(getpid(), 12345, sample(), "coop-wire-test"));
  auto r = listener->receive(1000);
  ASSERT_TRUE(r);
  ASSERT_TRUE(r->message);
  EXPECT_TRUE(r->sender.has_credentials);
  EXPECT_EQ(r->sender.pid, getpid());
  EXPECT_EQ(r->sender.uid, geteuid());
  // The reply goes back to the sender's autobound address.
  Message reply = sample();
  reply.kind = Kind::reply;
  ASSERT_TRUE(listener->send_to(r->from, r->from_len, reply));
  auto back = sender->receive(1000);
  ASSERT_TRUE(back && back->message);
  EXPECT_EQ(back->message->kind, Kind::reply);
  // Another start time is another name: a recycled pid is never reached.
  EXPECT_FALSE(sender->send_to(getpid(), 12346, sample(), "coop-wire-test"));
  // A second listener cannot take a name in use.
  EXPECT_FALSE(Socket::listen(getpid(), 12345, "coop-wire-test"));
}
