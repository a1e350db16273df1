#include "support/support.h"

TEST(OptLevelTest, ParsesTheFourLevels) {
  EXPECT_EQ(amp::parse_opt_level("O0"), amp::OptLevel::O0);
  EXPECT_EQ(amp::parse_opt_level("O1"), amp::OptLevel::O1);
  EXPECT_EQ(amp::parse_opt_level("O2"), amp::OptLevel::O2);
  EXPECT_EQ(amp::parse_opt_level("O3"), amp::OptLevel::O3);
  for (auto level : {amp::OptLevel::O0, amp::OptLevel::O1, amp::OptLevel::O2, amp::OptLevel::O3}) {
    EXPECT_EQ(amp::parse_opt_level(amp::to_string(level)), level);
  }
}

TEST(OptLevelTest, RejectsEverythingElseWithApexsHint) {
  for (const char* bad : {"01", "O4", "o1", " O1", "O1 ", "", "O", "O10", "3"}) {
    ASSERT_THROWS_WITH(amp::parse_opt_level(bad), std::string("'") + bad + "'");
    ASSERT_THROWS_WITH(amp::parse_opt_level(bad), "Options are 'O0', 'O1', 'O2', 'O3'");
    ASSERT_THROWS_WITH(amp::parse_opt_level(bad), "the prefix O is the letter O, not the number zero");
  }
  EXPECT_THROW(amp::parse_opt_level("01"), std::invalid_argument);
}

TEST(OptLevelTest, BriefsAreApexs) {
  EXPECT_EQ(amp::brief(amp::OptLevel::O0), "O0:  Pure FP32 training.");
  EXPECT_EQ(amp::brief(amp::OptLevel::O1), "O1:  Insert automatic casts around Pytorch functions and Tensor methods.");
  EXPECT_EQ(amp::brief(amp::OptLevel::O2), "O2:  FP16 training with FP32 batchnorm and FP32 master weights.");
  EXPECT_EQ(amp::brief(amp::OptLevel::O3), "O3:  Pure FP16 training.");
}
